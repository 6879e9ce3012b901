"""``python -m spscan calibrate``: fit and cache this machine's step-cost profile (:mod:`spscan.cli.calibration`)."""

from __future__ import annotations

import argparse

import torch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m spscan calibrate",
                                     description="Time small models through the scan and through autograd, fit the "
                                                 "step-cost profile spscan.wrap(backward='auto') predicts from, and "
                                                 "cache it for this machine, torch build and thread count.")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads to calibrate for (default: torch's)")
    parser.add_argument("--reps", type=int, default=7, help="timed steps per measurement (default 7)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from spscan.cli.calibration import calibrate
    from spscan.runtime.choices import current_key
    from spscan.planner.step_profile import cache_dir

    dev = torch.device(args.device) if args.device else None
    prof = calibrate(dev, reps=args.reps, log=print)
    print(f"saved {cache_dir() / (current_key(torch.device(prof.device_type)) + '.json')}")
    return 0
