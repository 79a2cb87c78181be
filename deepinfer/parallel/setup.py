"""The ParallelState a rank starts with, from EngineArgs and the model's config; and the start-up
checks every rank and the driver run the same way (one clear message, nothing half-started)."""

from __future__ import annotations

from .placement import ExpertPlacement, PlacementError, check_sizes
from .state import ParallelState


def check_parallel_args(args, model_args, num_devices: int | None) -> None:
    """Parallel sizes that cannot work, before any process starts. num_devices: visible GPUs (None
    on a CPU run, where ranks are processes)."""
    n = args.data_parallel_size
    if num_devices is not None and n > num_devices:
        raise PlacementError(f"data_parallel_size={n} exceeds the {num_devices} visible GPU(s)")
    if args.expert_parallel:
        check_sizes(model_args.n_routed_experts, args.num_redundant_experts, n)
    elif args.num_redundant_experts or args.enable_eplb:
        raise PlacementError("num_redundant_experts / enable_eplb need expert_parallel=True")


def initial_placement(args, model_args) -> ExpertPlacement | None:
    if not args.expert_parallel:
        return None
    L, E, n = model_args.n_layers, model_args.n_routed_experts, args.data_parallel_size
    if args.eplb_placement_file:
        placement = ExpertPlacement.load(args.eplb_placement_file, L, E, n)
        if placement.num_physical != E + args.num_redundant_experts:
            raise PlacementError(f"{args.eplb_placement_file}: {placement.num_physical} slots per layer, but "
                                 f"{E} experts + num_redundant_experts={args.num_redundant_experts} were asked")
        return placement
    return ExpertPlacement.initial(L, E, args.num_redundant_experts, n)


def parallel_state(args, model_args, rank: int, world_size: int) -> ParallelState:
    placement = initial_placement(args, model_args)
    recorder = None
    if args.enable_eplb and placement is not None:
        from .eplb.recorder import ExpertLoadRecorder
        recorder = ExpertLoadRecorder(model_args.n_layers, model_args.n_routed_experts, args.eplb_window_size)
    return ParallelState(rank=rank, world_size=world_size, backend=args.ep_backend, placement=placement,
                         recorder=recorder, engram_sharded=args.resolved_engram_placement() == "sharded")
