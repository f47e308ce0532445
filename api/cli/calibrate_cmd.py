"""``foldtune calibrate``: microbenchmark the local devices and save a calibrated hardware profile.

Runs GEMM, grouped-GEMM, memory-copy, launch-overhead and collective benchmarks on ``--ranks`` local ranks (NCCL on
GPUs, gloo on CPU), builds a HardwareProfile from the ``--gpu`` catalog profile with the measured curves
(units: docs/time-model.md, "Calibration hooks"), writes it to ``--out`` and, with ``--store``, to the
service database. ``foldtune plan/tune --profile FILE`` price layouts with it.
"""

from __future__ import annotations

import argparse

HELP = "measure the local GPUs (or CPU ranks) and save a calibrated hardware profile"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", help="catalog hardware profile to start from (default: guessed from the device; "
                                      "'cpu' runs CPU ranks with gloo)")
    parser.add_argument("--ranks", type=int, help="local ranks (default: every GPU, or 4 CPU ranks)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"),
                        help="GEMM precision (default: bf16 on GPUs, fp32 on CPU)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes per benchmark (CI, smoke tests)")
    parser.add_argument("--name", help="name of the calibrated profile (default: <gpu>-calibrated)")
    parser.add_argument("--out", metavar="FILE", help="JSON file to write (default: <data dir>/hardware/<name>.json)")
    parser.add_argument("--store", action="store_true", help="also store the profile in the service database")
    parser.add_argument("--database-url", help="database for --store (default: FOLDTUNE_DATABASE_URL or the data dir)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before the run is stopped")


def _guess_gpu(device_name: str) -> str:
    from costmodel.errors import SpecError

    lowered = device_name.lower()
    for key in ("h200", "h100", "a100"):
        if key in lowered:
            return key
    raise SpecError(f"no catalog profile matches the device {device_name!r}; name one with --gpu")


def _store(profile, url: str | None) -> str:
    from sqlalchemy import select

    from api.cli._db import migrate_or_explain
    from costmodel.errors import FoldtuneError
    from db.engine import make_engine, make_sessionmaker
    from db.models import HardwareProfileRow
    from db.settings import database_settings

    url = database_settings(url).url
    migrate_or_explain(url)
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            row = session.scalar(select(HardwareProfileRow).where(HardwareProfileRow.name == profile.name))
            if row is None:
                session.add(HardwareProfileRow(name=profile.name, profile=profile.to_dict(), source="calibrate"))
            elif row.source != "calibrate":
                raise FoldtuneError(f"the database already holds a hardware profile {profile.name!r} that "
                                    f"calibrate did not write; choose another --name")
            else:  # a re-calibration of the same machine replaces the previous measurement
                row.profile = profile.to_dict()
            session.commit()
    finally:
        engine.dispose()
    return url


def run(args: argparse.Namespace) -> int:
    import torch

    from costmodel.catalog import get_hardware
    from costmodel.errors import SpecError
    from costmodel.profile_io import save_profile
    from db.settings import default_data_dir
    from executor.microbench.profile_builder import build_profile
    from executor.microbench.runner import BenchPlan, run_benchmarks

    cpu = (args.gpu or "").lower() == "cpu" or (args.gpu is None and not torch.cuda.is_available())
    if args.gpu:
        get_hardware(args.gpu)  # an unknown name is the first thing to report
    if not cpu and not torch.cuda.is_available():
        raise SpecError(f"--gpu {args.gpu} needs CUDA GPUs and this machine has none (--gpu cpu runs CPU ranks)")
    gpu = "cpu" if cpu else (args.gpu or _guess_gpu(torch.cuda.get_device_name(0)))
    base = get_hardware(gpu)
    ranks = args.ranks if args.ranks is not None else (4 if cpu else torch.cuda.device_count())
    if ranks < 1:
        raise SpecError(f"--ranks must be >= 1, got {ranks}")
    precision = args.precision or ("fp32" if cpu else "bf16")
    name = (args.name or f"{base.name}-calibrated").lower()
    print(f"calibrating {base.name} on {ranks} {'CPU rank(s), gloo' if cpu else 'GPU(s), NCCL'}, {precision}"
          f"{', quick' if args.quick else ''}", flush=True)
    raw = run_benchmarks(ranks, BenchPlan(precision=precision, quick=args.quick), device="cpu" if cpu else "cuda",
                         timeout_s=args.timeout)
    profile = build_profile(base, raw, name)
    out = save_profile(profile, args.out or default_data_dir() / "hardware" / f"{name}.json", raw)
    print("GEMM efficiency (FLOPs -> of peak): "
          + ", ".join(f"{x:.3g}:{y:.3f}" for x, y in profile.gemm_efficiency.points))
    print("grouped GEMM (tokens/expert -> of peak): "
          + ", ".join(f"{x:.0f}:{y:.3f}" for x, y in profile.grouped_gemm_efficiency.points))
    print(f"memory copy: {profile.hbm_efficiency:.3f} of {base.gpu.hbm_bandwidth / 1e9:.0f} GB/s")
    print(f"launch overhead: {profile.op_launch_seconds * 1e6:.2f} us per eager op"
          + (f", {profile.collective_launch_s * 1e6:.2f} us per small collective"
             if profile.collective_launch_s is not None else "")
          + (f", {profile.moe_layer_host_s * 1e3:.3f} ms per executor MoE layer (tiny shapes, fwd+bwd)"
             if profile.moe_layer_host_s is not None else ""))
    for key, curve in profile.collective_efficiency:
        print(f"{key:<22} " + ", ".join(f"{x / 2**20:.3g}MiB:{y:.3g}" for x, y in curve.points))
    print(f"profile {profile.name!r} written to {out}")
    if args.store:
        print(f"stored as hardware profile {profile.name!r} in {_store(profile, args.database_url)}")
    return 0
