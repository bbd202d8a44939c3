"""Renders benchmark reports (run.py's JSON, the GPU tests' JSON) as markdown tables.

    python benchmarks/render.py overhead.json [fit.json gpu_check.json ...]

Pure Python: it needs neither TensorFlow nor tfdls. One table per report: a
row per case, a column per variant. See benchmarks/README.md.
"""

import argparse
import json
import sys

UNITS = {"overhead": "ms/step of `apply`", "boundaries": "ms/training step",
         "fit": "ms/step of `fit`, then the first step (trace, compile, one step) in s",
         "allreduce": "ms/training step of worker 0 (MultiWorkerMirroredStrategy, gRPC on "
                      "127.0.0.1), then MB all-reduced per step and worker"}


def load(path):
    """The reports in one JSON file (a report, or a list of them)."""
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _ratio_of(result, key, over, under, minus=0.0):
    """``(variants[over][key] - minus) / (variants[under][key] - minus)``, or None."""
    v = result["variants"]
    if over not in v or under not in v or v[under][key] - minus <= 0:
        return None
    return (v[over][key] - minus) / (v[under][key] - minus)


# Columns after the variants, per family: (title, cell of one result).
EXTRAS = {
    "overhead": [
        ("tfdls/Keras 3 overhead", lambda r: _fmt(_ratio_of(r, "ratio", "tfdls", "keras3", 1.0),
                                                  ".2f")),
        ("floor fused", lambda r: f"{r['floor']['floor_fused']:.2f}x"),
        ("floor unfused", lambda r: f"{r['floor']['floor_unfused']:.2f}x"),
    ],
    "allreduce": [("float16/float32 bytes",
                   lambda r: _fmt(_ratio_of(r, "all_reduce_bytes", "tfdls_f16", "tfdls"), ".3f")),
                  ("float16 step / Keras 3 step",
                   lambda r: _fmt(_ratio_of(r, "ms", "tfdls_f16", "keras3"), ".2f"))],
    "fit": [("first step tfdls/Keras 3",
             lambda r: _fmt(_ratio_of(r, "first_s", "tfdls", "keras3"), ".2f"))],
}


def _tfdls_to(name):
    return lambda r: _fmt(r.get("tfdls_to", {}).get(name), ".2f")


def cell(family, v, baseline):
    """One variant's cell: ms (ratio [p25-p75]), and what its family adds."""
    if "ms" not in v:  # a GPU check's value
        return str(v.get("value", "-"))
    text = f"{v['ms']:.2f}"
    if not baseline:
        text += f" ({v['ratio']:.2f}x [{v['ratio_p25']:.2f}-{v['ratio_p75']:.2f}])"
    if v.get("factors"):
        text += f", {len(v['factors'])} b"
    if family == "fit":
        text += f"; {v['first_s']:.1f} s"
    if "all_reduce_bytes" in v:
        text += f"; {v['all_reduce_bytes'] / 1e6:.2f} MB"
    return text


def environment_line(env):
    """"Date: ...; machine: ...; versions." of one report."""
    machine = ", ".join([env["machine"]] + list(env.get("gpus") or []))
    line = (f"Date: {env['date']}; machine: {machine}; Python {env['python']}; "
            f"TensorFlow {env['tensorflow']}; Keras {env['keras']}")
    if env.get("tf_keras"):
        line += f"; tf_keras {env['tf_keras']}"
    return line + f"; tfdls {env['tfdls']} (sources sha256 {env.get('tfdls_source_sha256')})."


def markdown(report):
    """The markdown of one report: the environment, the settings, then a table per set of
    variants (a row per case, a column per variant, the baseline first)."""
    family, s = report["family"], report["settings"]
    labels = report.get("labels", {})
    extras = EXTRAS.get(family, [])
    lines = [environment_line(report["environment"])]
    if family in UNITS:
        lines += ["", f"Family {family} on {s['device']}" + (
            f", policy {s['policy']}" if s.get("policy") else f", {s['dtype']} gradients")
            + f", TF_ENABLE_ONEDNN_OPTS {s.get('onednn')}: median {UNITS[family]} of "
            f"{s['rounds']} interleaved rounds; ratio: median per-round ratio to the first "
            "column [p25-p75]; b: scale boundaries."]
    groups = {}
    for r in report["results"]:
        groups.setdefault(tuple(r["variants"]), []).append(r)
    for names, results in groups.items():
        # A tfdls/Keras 3 column only where both ran (not against `global`).
        shown = [(t, fn) for t, fn in extras if "Keras 3" not in t
                 or {"tfdls", "keras3"} <= set(names)]
        # tfdls against itself at other commits (run.py --at): its median per-round ratio.
        shown += [(f"tfdls / {labels.get(n, n)}", _tfdls_to(n)) for n in names
                  if any(n in r.get("tfdls_to", {}) for r in results)]
        lines += ["", "| case (calls) | " + " | ".join(labels.get(n, n) for n in names)
                  + "".join(f" | {title}" for title, _ in shown) + " |",
                  "|---|" + "---:|" * (len(names) + len(shown))]
        for r in results:
            cells = [cell(family, r["variants"][n], n == names[0]) for n in names]
            cells += [fn(r) for _, fn in shown]
            calls = f" ({r['calls']})" if "calls" in r else ""
            lines.append(f"| {r['case']}{calls} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="report.json")
    args = parser.parse_args(argv)
    reports = [r for path in args.paths for r in load(path) if r.get("benchmark") == "tfdls"]
    if not reports:
        sys.exit("no tfdls benchmark reports in " + ", ".join(args.paths))
    text = "\n\n".join(markdown(r) for r in reports)
    print(text)
    return text


if __name__ == "__main__":
    main()
