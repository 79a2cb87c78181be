"""Speculative decoding with DSpark: proposing drafts (tensors, called by the runner) and choosing
which to verify (plain floats, called by the scheduler). The acceptance rules live with the
sampler (deepinfer/sample/rejection.py).

    dspark_proposer.py  DSparkProposer: absorb accepted rows into the DSpark rings, draft k tokens
                        with confidence logits (greedy, or sampled with q kept for "sampled" acceptance)
    draft_book.py       DraftBook: the scheduler's ledger of proposals until the next schedule() plans them
    policy.py           DraftEntry, prefix survival, VerifyAllPolicy, StaticThresholdPolicy, FixedDraftsPolicy
    budget.py           VerifyBudgetPolicy: the batch-wide budget maximizing expected accepted tokens
                        per profiled step second, split by the newest confidences (DSpark Algorithm 1)
    older_calibration.py  OlderCalibration: what a request's previous proposal predicts about its
                        current one, measured online (the budget's "older" confidences)
    step_time.py        StepTimeModel and its profile through the engine's own steps at start
    step_time_cache.py  the profile kept across starts under a fingerprint (EngineArgs.spec_step_time_cache)
    step_time_online.py StepTimeObserver: the model corrected by finished verify steps (spec_step_time_online)
    pause.py            DraftingGate: no drafting after a step where plain decode steps are faster
                        (EngineArgs.spec_pause; SchedulerOutput.draft_after)
    engine_policy.py    EngineArgs.spec_policy -> the policy in every scheduler's DraftBook
    replay.py           ReplayedAcceptance: the benchmark mode's stated acceptance distribution
    device_resolution.py  a verify step resolved on the device: accepted counts, new tokens, the next
                        anchor / positions / draft slots (the runner reads one copy of it at resolve)
    reservation.py      a verify step scheduled with the previous one in flight: worst-case drafts and
                        blocks, trimmed when the accepted counts arrive (Scheduler.schedule_overlapped)
    overlap.py          verify steps that overlap under async scheduling: who may draft on the device,
                        the next step's inputs gathered from the resolution (ModelRunner.launch_overlapped)
    overlap_verify.py   the verification policy inside overlapped steps, host half: B from the older
                        confidences (Scheduler.schedule_overlapped)
    device_verify.py    its device half: the split of B (or the threshold) by the newest confidences,
                        k_i <= K' per request as a tensor (the overlapped build)
"""
