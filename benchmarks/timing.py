"""The one timing loop: the first call, a warm-up, interleaved rounds, and the checks.

Every family's variants are `runs.Run`s; benchmarks/README.md ("How it is
timed") explains the choices.
"""

import statistics
import time


def measure(runs, rounds, calls, warmup=1):
    """Times `runs` (the variants of one case, the baseline first).

    First each variant's first unit alone (tracing, compiling and one unit:
    `first_s`), then `warmup` untimed calls of `calls` units, then `rounds`
    rounds that each time every variant once, `calls` units and a sync, in an
    order that rotates from round to round so that slow drift of a loaded
    machine hits all alike. Each variant is checked after the warm-up and
    after timing (`Run.check`), and must not be traced again while timed.

    Args:
        runs: the `runs.Run`s, built (all of them before any is called:
            building a model sets the global seed, which retraces the others).
        rounds: timed rounds.
        calls: units per timed call.
        warmup: untimed calls per variant before timing.

    Returns:
        By name: ms (per unit, median of rounds), ratio (median per-round
        ratio to the baseline's time in the same round), ratio_p25, ratio_p75,
        samples_ms, first_s; then what `Run.record` adds.

    Raises:
        RuntimeError: a check failed.
    """
    first = {}
    for run in runs:
        start = time.perf_counter()
        run.call(1)
        first[run.name] = time.perf_counter() - start
    for run in runs:
        for _ in range(warmup):
            run.call(calls)
        run.check("during warm-up")
    # A first trace that creates variables is traced twice; timing must never trace.
    traces = [run.traces() for run in runs]
    times = {run.name: [] for run in runs}
    for r in range(rounds):
        shift = r % len(runs)
        for run in runs[shift:] + runs[:shift]:
            start = time.perf_counter()
            run.call(calls)
            times[run.name].append((time.perf_counter() - start) / calls)
    for run, count in zip(runs, traces):
        run.check("during timing")
        if run.traces() != count:
            raise RuntimeError(f"{run.name}: the step was traced again while timed")
    stats = summarize(times)
    return {run.name: dict(stats[run.name], first_s=first[run.name], **run.record())
            for run in runs}


def summarize(times):
    """Medians of ms/unit and of the per-round ratio to the first entry (the baseline).

    Args:
        times: seconds per unit, one sample per round, by name.

    Returns:
        By name: ms, ratio, ratio_p25, ratio_p75, samples_ms.
    """
    baseline = next(iter(times.values()))
    summary = {}
    for name, samples in times.items():
        ratios = [t / b for t, b in zip(samples, baseline)]
        quartiles = (statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1
                     else ratios * 3)
        summary[name] = {"ms": 1000.0 * statistics.median(samples),
                         "ratio": statistics.median(ratios),
                         "ratio_p25": quartiles[0], "ratio_p75": quartiles[-1],
                         "samples_ms": [1000.0 * t for t in samples]}
    return summary
