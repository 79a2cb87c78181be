"""pull.py's state machine on a fake transport (no NIXL): the transitions both decode halves drive."""

import torch

from deepinfer.disagg.pull import Pull, Puller, PullJob, free_msg, parse_frees, read_failed

PEER_TAG_ADDR = 0x1000


class FakeTransport:
    """READs finish when told (finish()); a READ of the peer's tag lands peer_tag in our tags."""

    def __init__(self, tags: torch.Tensor, peer_tag: int) -> None:
        self.tags, self.peer_tag = tags, peer_tag
        self.ready, self.fail_post = False, False
        self.states: dict[int, str] = {}
        self.tag_reads: dict[int, int] = {}        # handle -> local slot its tag lands in
        self.notes, self.forgotten, self.released = [], [], []

    def peer_ready(self, name, host, port):
        return self.ready

    def read(self, peer, local, remote, mem_type):
        if self.fail_post:
            raise ConnectionError(f"NIXL READ from {peer} could not be posted")
        handle = len(self.states)
        self.states[handle] = "PROC"
        if remote == [(PEER_TAG_ADDR, 8, 0)]:
            self.tag_reads[handle] = (local[0][0] - self.tags.data_ptr()) // 8
        return handle

    def finish(self, handle, state="DONE"):
        self.states[handle] = state
        if state == "DONE" and handle in self.tag_reads:
            self.tags[self.tag_reads[handle]] = self.peer_tag

    def state(self, handle):
        return self.states[handle]

    def release(self, handle):
        self.released.append(handle)

    def notify(self, peer, msg):
        self.notes.append((peer, msg))

    def forget_peer(self, name):
        self.forgotten.append(name)


def make(peer_tag=7, runs=True):
    tags = torch.zeros(4, dtype=torch.int64)
    t = FakeTransport(tags, peer_tag)
    job = PullJob("r", "peer", "h", 1, [(0, 8, 0)] if runs else [], [(0, 8, 0)] if runs else [], 2,
                  PEER_TAG_ADDR, 7, "pr")
    return t, Puller(t, tags, "DRAM"), Pull(job)


def test_connect_pull_verify_notify():
    t, puller, pull = make()
    assert puller.step(pull) is None and pull.state == "CONNECT"      # no metadata yet
    t.ready = True
    assert puller.step(pull) is None and pull.state == "PULL"
    t.finish(pull.handle)
    assert puller.step(pull) is None and pull.state == "VERIFY" and t.released == [0]
    t.finish(pull.handle)
    assert puller.step(pull) is None and pull.state == "DONE" and pull.handle is None
    assert t.notes == [("peer", b"free:pr:7")] and parse_frees([b"x:y", t.notes[0][1]]) == [("pr", "7")]


def test_no_runs_go_straight_to_verify():
    t, puller, pull = make(runs=False)
    t.ready = True
    assert puller.step(pull) is None and pull.state == "VERIFY" and list(t.tag_reads) == [0]   # one READ: the tag


def test_a_changed_tag_fails_without_a_free():
    t, puller, pull = make(peer_tag=8)
    t.ready = True
    puller.step(pull)
    t.finish(pull.handle)
    puller.step(pull)
    t.finish(pull.handle)
    why = puller.step(pull)
    assert "no longer exist on prefill instance peer" in why and pull.handle is None and t.notes == []


def test_a_read_in_err_forgets_the_peer():
    t, puller, pull = make()
    t.ready = True
    puller.step(pull)
    t.finish(pull.handle, "ERR")
    assert puller.step(pull) == read_failed("peer", "h", 1) and t.forgotten == ["peer"] and pull.handle is None


def test_an_exception_is_a_transient_failure():
    t, puller, pull = make()
    t.ready, t.fail_post = True, True
    assert puller.step(pull).endswith("failed: ConnectionError: NIXL READ from peer could not be posted")


def test_a_stop_keeps_a_read_still_landing():
    t, puller, pull = make()
    t.ready = True
    puller.step(pull)
    puller.stop(pull, "abort")
    assert t.notes == [("peer", free_msg("pr", 7))] and pull.handle == 0 and t.released == []
    t.finish(0)
    puller.stop(pull, "timeout")
    assert t.forgotten == ["peer"] and pull.handle is None and t.released == [0]
