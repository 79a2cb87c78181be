"""Prefill/decode disaggregation: one instance runs prompts, another continues the decode, the
request's caches moving between them through NIXL (UCX over TCP/shared memory on CPU, RDMA/NVLink
for GPU memory). vLLM's connector shape: the prefill side returns `kv_transfer_params` with its
final output, the decode side pulls the blocks those params name (a one-sided READ) and goes on.

    params.py      KVTransferParams: what a prefill instance hands over (JSON; travels through the
                   gateway with the request)
    layout.py      CacheLayout: which bytes of ModelCaches hold one request's state (window ring rows
                   of every layer incl. the DSpark rings, compressor carry, compressed-KV and index-key
                   blocks), as (address, length) runs; the layout signature both peers must share
    nixl_transport.py  NixlTransport: the NIXL agent (registration, peer metadata, READ, notifications)
    pull.py        Puller, Pull, PullJob: one request's pull (CONNECT -> PULL -> VERIFY -> notify the
                   peer; a READ in ERR, a gone tag, abort, timeout), the one state machine both
                   connectors drive (in the engine's process, or in each rank worker's); the
                   "free:<id>:<nonce>" word and the transient failures' wording
    connector.py   KVConnector: the engine's one interface (request_finished on the prefill side,
                   start_load / poll on the decode side; holds, deadlines, freeing)
    process.py     EngineProcess: an AsyncEngine in a child process (tests, benchmarks)
    rank_connector.py  RankKVConnector: the engine's connector when the caches live in rank workers
                   (data_parallel_size > 1): holds, deadlines, pull states, slots, blocks and runs per
                   rank; a hand-over names the prefill rank holding it, a pull goes to the decode rank
                   the DP scheduler's placement picks; one round trip to the ranks a step, after it
    rank_transfer.py   RankTransfer: a rank worker's half: its own NIXL agent over its own caches and
                   tag array (writes the nonces, steps its pulls through pull.py, reads notifications),
                   and the RankKVCommands / RankKVReport that cross the executor's ("kv", ...) message

What moves (MODEL.md "the caches"): the window ring rows of the last WINDOW positions of every
layer (backbone and DSpark blocks), the fp32 compressor carry rows of each unfinished group (n % ratio
positions), the compressed-KV and index-key blocks of positions 0..n-1 (layout.py). Engram history is the token ids (sent in
the request), so nothing of it moves. With kv_transfer_window=False (decode side) only the blocks
below H = n rounded down to a block move, and the decode rebuilds the window by the prefix cache's
bounded replay of positions [H - swa_replay_tokens, n] (outputs.ReplayParams through the scheduler).

    prefill instance                                   decode instance
    run prompt, sample t0 -> final output + params     add_request(prompt, kv_transfer_params=...)
    hold slot + blocks, tag[slot] = nonce              allocate slot + blocks
                                                       READ ring rows, carry rows, blocks
                                                       READ tag[slot]: still the nonce? (else freed)
    notif "free:<id>:<nonce>" -> free      <---------- notify; continue at position n with t0
    (or free at kv_transfer_timeout_s)                 (fail with a clear error on timeout / peer down)
"""

from deepinfer.disagg.params import KVTransferParams

__all__ = ["KVTransferParams"]
