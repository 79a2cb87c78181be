# The README's two commands. Both set up .venv on a fresh machine first.
PY := .venv/bin/python
CHECKPOINT ?= checkpoints/tiny
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# GATEWAY_PORT=9000: also start the OpenAI/Anthropic HTTP gateway (ensemble/gateway.py)
GATEWAY_PORT ?=
PYTEST_ARGS ?=
# two pytest-xdist workers, a test file each at a time (module fixtures stay in one worker): CI has two
# cores and a serial run leaves one idle about half the time (2026-12-05: 1:35 serial, 1:02 with two)
PYTEST_WORKERS ?= -n 2 --dist loadfile

.PHONY: venv serve test checkpoint

venv:
	./scripts/setup-venv.sh

checkpoint: venv
	@[ -f $(CHECKPOINT)/config.json ] || $(PY) -m deepinfer.cli.make_checkpoint --preset tiny --seed 0 --out $(CHECKPOINT)

serve: venv checkpoint
	$(PY) -m deepinfer.ensemble.serve --checkpoint $(CHECKPOINT) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		$(if $(GATEWAY_PORT),--gateway-port $(GATEWAY_PORT))

test: venv
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)
