"""``python -m crossalign.tasks --store S --run R --step NAME``: one step as its own process.

Used by the embedded launcher (a subprocess per step), by SSH runners on remote hosts, and by
hand to redo a step (the manifests record this command). Progress goes to stdout as marked
lines; the exit code tells the launcher whether another attempt could help (see tasks.errors).
"""

from __future__ import annotations

import argparse
import sys
import traceback

from crossalign.site import load_site
from crossalign.store import RunStore
from crossalign.tasks import run_step
from crossalign.tasks.errors import EXIT_DETERMINISTIC, EXIT_OK, EXIT_RETRYABLE
from crossalign.tasks.progress import print_progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crossalign.tasks", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="the run store folder")
    parser.add_argument("--run", required=True, help="the run id")
    parser.add_argument("--step", required=True, help="the step name, e.g. convert")
    parser.add_argument("--embedded", action="store_true", help="train with the CPU backends whatever the site says")
    parser.add_argument("--site", default=None, help="the site config file")
    args = parser.parse_args(argv)
    try:
        site = load_site(args.site)
        if args.embedded:
            site = site.model_copy(update={"backends": {"npu": "local", "gpu": "local"}})
        run = RunStore(args.store).run(args.run)
        manifest = run_step(run, args.step, site, on_step=print_progress)
    except (ValueError, LookupError, ImportError, AssertionError) as exc:
        traceback.print_exc()
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_DETERMINISTIC
    except (OSError, ConnectionError, TimeoutError) as exc:
        traceback.print_exc()
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_RETRYABLE
    print(f"step {manifest['step']} done in {manifest['seconds']:.1f} s on {manifest['host']}", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
