"""KVTransferParams: a prefill instance's hand-over of one request (vLLM's kv_transfer_params).

A plain JSON object so it can ride with the request through the gateway and the Triton ensemble.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


# How a decode instance's error for a pull that failed for a transient reason (the prefill's agent
# unreachable or gone, a READ in error, the deadline passed) begins: the router retries the whole
# hand-over on another prefill replica when the decode answers with it (ensemble/router_server.py)
TRANSIENT_PULL_FAILURE = "the KV transfer from prefill instance"


@dataclass(frozen=True)
class KVTransferParams:
    engine_id: str                 # the prefill instance's NIXL agent name
    host: str                      # where its metadata listener is reached
    port: int
    request_id: str                # the request id on the prefill instance
    num_tokens: int                # positions 0..num_tokens-1 are in the caches (the prompt)
    first_token_id: int            # the token the prefill sampled at position num_tokens
    ring_slot: int                 # the prefill's ring slot of the request
    block_ids: tuple[int, ...]     # the prefill's block table
    tag: int                       # nonce written at tag[ring_slot] while the caches are held
    base_addrs: tuple[int, ...]    # the prefill's base address of each layout region (layout order)
    tag_addr: int                  # address of the prefill's tag array
    layout: str                    # CacheLayout.signature of the prefill instance
    num_bytes: int = 0             # bytes a decode instance reads for this request
    dev_id: int = 0                # the GPU of the prefill's caches (its rank's, with rank workers): the
                                   # remote descriptors' device id, which NIXL matches with its registration

    def to_dict(self) -> dict:
        d = asdict(self)
        d["block_ids"], d["base_addrs"] = list(self.block_ids), list(self.base_addrs)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferParams":
        """Raises ValueError with the missing / unknown key names on a malformed object."""
        if not isinstance(d, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.name not in ("num_bytes", "dev_id")}
        missing, unknown = required - set(d), set(d) - names
        if missing or unknown:
            raise ValueError(f"kv_transfer_params: missing {sorted(missing)}, unknown {sorted(unknown)}")
        try:
            return cls(**{**d, "block_ids": tuple(int(b) for b in d["block_ids"]),
                          "base_addrs": tuple(int(a) for a in d["base_addrs"]),
                          "num_tokens": int(d["num_tokens"]), "first_token_id": int(d["first_token_id"]),
                          "ring_slot": int(d["ring_slot"]), "tag": int(d["tag"]), "port": int(d["port"]),
                          "dev_id": int(d.get("dev_id", 0))})
        except (TypeError, ValueError) as e:
            raise ValueError(f"kv_transfer_params: {e}") from None
