"""Renders benchmark JSON results (bench_overhead.py, bench_fit.py, bench_boundaries.py,
gpu_check.py) as text or markdown.

    python benchmarks/render.py results.json [more.json ...]

Pure Python: it needs neither TensorFlow nor tfdls. Reports that share a
machine, versions, device, dtype and round count are merged into one table.
See benchmarks/README.md.
"""

import argparse
import json
import sys

BASELINE = "bare"


def load(path):
    """Reads one JSON report written by bench_overhead.py, bench_fit.py, bench_boundaries.py
    or gpu_check.py."""
    with open(path) as f:
        return json.load(f)


def overhead_reports(report):
    """The bench_overhead reports inside `report` (a gpu_check report holds one)."""
    if report.get("benchmark") == "bench_overhead":
        return [report]
    inner = report.get("overhead")
    if isinstance(inner, dict) and inner.get("benchmark") == "bench_overhead":
        return [inner]
    return []


def fit_reports(report):
    """The bench_fit reports inside `report` (a gpu_check report holds one)."""
    inner = report.get("transformer_fit") if report.get("benchmark") == "gpu_check" else report
    return [inner] if isinstance(inner, dict) and inner.get("benchmark") == "bench_fit" else []


def overhead_vs_keras(result):
    """tfdls' overhead as a fraction of Keras 3's: (tfdls - 1) / (keras3 - 1), or None."""
    v = result["variants"]
    if "keras3" not in v or "tfdls" not in v:
        return None
    keras_over = v["keras3"]["ratio"] - 1.0
    if keras_over <= 0:
        return None
    return (v["tfdls"]["ratio"] - 1.0) / keras_over


def columns(results):
    """Variant names in order of first appearance over `results`."""
    names = []
    for r in results:
        names += [n for n in r["variants"] if n not in names]
    return names


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


# -- text (what bench_overhead.py prints) ------------------------------------------


def text_table(results):
    """The plain-text table: ms, ratio and [p25-p75] per variant, then the floors."""
    names = columns(results)
    width = max([26] + [len(r["workload"]) + 1 for r in results])
    lines = [f"{'workload':<{width}}" + "".join(f"{n:>28}" for n in names)
             + f"{'tfdls/keras3 over':>19}"]
    for r in results:
        row = f"{r['workload']:<{width}}"
        for n in names:
            v = r["variants"].get(n)
            cell = "-" if v is None else (
                f"{v['ms']:.2f}ms {v['ratio']:.3f}x [{v['ratio_p25']:.2f}-{v['ratio_p75']:.2f}]"
            )
            row += f"{cell:>28}"
        row += f"{_fmt(overhead_vs_keras(r), '.2f'):>19}"
        lines.append(row)
    lines += ["", "memory-pass floors (ratio to bare; see benchmarks/README.md):"]
    for r in results:
        f = r["floor"]
        lines.append(
            f"  {r['workload']:<{width}} grads {f['grad_bytes'] / 2**20:8.1f} MiB, "
            f"vars {f['var_bytes'] / 2**20:8.1f} MiB, bare {f['bare_passes']} passes "
            f"({f['bare_bytes'] / 2**20:.0f} MiB); floor fused {f['floor_fused']:.3f}x, "
            f"unfused {f['floor_unfused']:.3f}x"
        )
    return "\n".join(lines)


def text_report(report):
    """A settings line, then `text_table` of a bench_overhead report."""
    s = report["settings"]
    return (f"\ndevice {s['device']}, dtype {s['dtype']}, {s['rounds']} rounds; "
            "cells: median ms/step, median ratio to bare [p25-p75]\n"
            + text_table(report["results"]))


# -- markdown ---------------------------------------------------------------------------


def environment_line(envs):
    """"Date: ...; machine: ...; versions." for one or more environments of one machine."""
    env = envs[0]
    dates = sorted({e["date"] for e in envs})
    machine = env["machine"]
    if env.get("gpus"):
        machine += ", " + ", ".join(env["gpus"])
    line = (f"Date: {', '.join(dates)}; machine: {machine}; Python {env['python']}; "
            f"TensorFlow {env['tensorflow']}; Keras {env['keras']}")
    if env.get("tf_keras"):
        line += f"; tf_keras {env['tf_keras']}"
    return line + f"; tfdls {env['tfdls']}."


def _group_key(report):
    env, s = report["environment"], report["settings"]
    same_machine = tuple(str(env.get(k)) for k in
                         ("machine", "gpus", "python", "tensorflow", "keras", "tf_keras", "tfdls"))
    return same_machine + (s["device"], s["dtype"], s["rounds"])


def overhead_markdown(reports):
    """One markdown table for bench_overhead reports of the same machine and settings."""
    results = [r for report in reports for r in report["results"]]
    labels = {}
    for report in reports:
        labels.update(report.get("labels", {}))
    s = reports[0]["settings"]
    names = columns(results)
    lines = [
        environment_line([r["environment"] for r in reports]),
        "",
        f"Device {s['device']}, dtype {s['dtype']}, median of {s['rounds']} interleaved "
        "rounds. Cells: ms/step and ratio to bare Keras 3 optimizer.",
        "",
        "| workload | " + " | ".join(labels.get(n, n) for n in names)
        + " | tfdls/Keras 3 overhead | floor fused | floor unfused |",
        "|---|" + "---:|" * (len(names) + 3),
    ]
    for r in results:
        cells = []
        for n in names:
            v = r["variants"].get(n)
            if v is None:
                cells.append("-")
            elif n == BASELINE:
                cells.append(f"{v['ms']:.2f}")
            else:
                cells.append(f"{v['ms']:.2f} ({v['ratio']:.2f}x)")
        f = r["floor"]
        lines.append(
            f"| {r['workload']} (calls {r['calls']}) | " + " | ".join(cells)
            + f" | {_fmt(overhead_vs_keras(r), '.2f')}"
            + f" | {f['floor_fused']:.2f}x | {f['floor_unfused']:.2f}x |"
        )
    return "\n".join(lines)


def gpu_check_markdown(report):
    """The fit, device-to-host and MirroredStrategy parts of a gpu_check report."""
    fit = report.get("fit") or {}
    dtoh = report.get("device_to_host") or {}
    mirrored = report.get("mirrored") or {}
    fit_runs = fit.get("optimizers", {})
    dtoh_runs = dtoh.get("optimizers", {})
    mirrored_runs = mirrored.get("runs", {})
    names = list(dict.fromkeys(list(fit_runs) + list(dtoh_runs) + list(mirrored_runs)))
    if not names:
        return ""
    lines = []
    if fit:
        lines += [f"`fit` under mixed_float16: {fit.get('model', '?')}, batch "
                  f"{fit.get('batch_size', '?')}, jit_compile={fit.get('jit_compile')}, median "
                  f"of {fit.get('repeats', '?')} fits of {fit.get('steps', '?')} steps. "
                  "Device-to-host copies per steady-state step from a profiler trace. "
                  f"MirroredStrategy on {', '.join(mirrored.get('devices', [])) or '-'} "
                  f"(jit_compile={mirrored.get('jit_compile')}).", ""]
    lines += ["| optimizer | fit ms/step | ratio to bare | DtoH copies/step | MirroredStrategy |",
              "|---|---:|---:|---:|---|"]
    bare_ms = fit_runs.get(BASELINE, {}).get("ms_per_step")
    for name in names:
        run = fit_runs.get(name, {})
        ms = run.get("ms_per_step")
        ratio = ms / bare_ms if ms is not None and bare_ms else None
        copies = dtoh_runs.get(name, {}).get("dtoh_per_step")
        m = mirrored_runs.get(name)
        if m is None:
            m_cell = "-"
        elif m.get("ok"):
            m_cell = f"ok, loss scale {_fmt(m.get('loss_scale'), 'g')}"
        else:
            m_cell = f"fails: {m.get('error_type', 'error')}"
        lines.append(f"| {name} | {_fmt(ms, '.2f')} | {_fmt(ratio, '.2f')}"
                     f" | {_fmt(copies, '.2f')} | {m_cell} |")
    return "\n".join(lines)


def fit_markdown(report):
    """The table of a bench_fit report: epoch time per optimizer and its ratio to bare."""
    s, plan = report["settings"], report["step_plan"]
    lines = [environment_line([report["environment"]]), "",
             f"`fit` under mixed_float16: {s['model']}; {s['samples']} sequences of "
             f"{s['seq_len']} tokens, batch {s['batch_size']}, jit_compile={s['jit_compile']}. "
             f"Median of {s['epochs']} interleaved epochs after {s['warmup_epochs']} warm-up; "
             f"tfdls step_plan.skip: {plan['skip']}"
             + (f" ({plan['reason']})" if plan.get("reason") else "") + ".", "",
             "| optimizer | epoch (s) | ratio to bare [p25-p75] | final loss | loss scale "
             "| applied steps |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in report["optimizers"].items():
        lines.append(f"| {name} | {r['ms'] / 1000:.3f} | {r['ratio']:.3f} "
                     f"[{r['ratio_p25']:.2f}-{r['ratio_p75']:.2f}] | {r['final_loss']:.4f} "
                     f"| {_fmt(r['loss_scale'], 'g')} | {r['applied_steps']}/{r['timed_steps']} |")
    return "\n".join(lines)


def boundaries_markdown(report):
    """The table of a bench_boundaries report: step time per variant, ratio to `global`."""
    s = report["settings"]
    results = report["results"]
    names = columns(results)
    labels = report.get("labels", {})
    baseline = names[0]
    env = report["environment"]
    source = env.get("tfdls_source_sha256")
    lines = [environment_line([env])
             + (f" tfdls sources sha256 {source}." if source else ""), "",
             f"One training step under {s['policy']} (forward, backward, `apply`; "
             f"{s['optimizer']}) on {s['device']}: median ms/step of {s['rounds']} interleaved "
             f"rounds and the median per-round ratio to {baseline} [p25-p75]; b = scale "
             "boundaries in the model.", "",
             "| workload (calls) | " + " | ".join(labels.get(n, n) for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    for r in results:
        cells = []
        for n in names:
            v = r["variants"].get(n)
            if v is None:
                cells.append("-")
            elif n == baseline:
                cells.append(f"{v['ms']:.2f}")
            else:
                bounds = f", {v['boundaries']} b" if v.get("boundaries") else ""
                cells.append(f"{v['ms']:.2f} ({v['ratio']:.2f}x [{v['ratio_p25']:.2f}-"
                             f"{v['ratio_p75']:.2f}]{bounds})")
        lines.append(f"| {r['workload']} ({r['calls']}) | " + " | ".join(cells) + " |")
    described = {}  # description -> workload name without its mode
    for r in results:
        described.setdefault(r["description"], r["workload"].rsplit("-", 1)[0])
    lines += [""] + [f"- {name}: {d}" for d, name in described.items()]
    return "\n".join(lines)


def markdown(reports):
    """Markdown for any mix of bench_overhead, bench_fit, bench_boundaries and gpu_check
    reports."""
    groups = {}
    for report in reports:
        for inner in overhead_reports(report):
            groups.setdefault(_group_key(inner), []).append(inner)
    sections = [overhead_markdown(group) for group in groups.values()]
    for report in reports:
        if report.get("benchmark") == "gpu_check":
            section = gpu_check_markdown(report)
            if section:
                sections.append(section)
    sections += [fit_markdown(fit) for report in reports for fit in fit_reports(report)]
    sections += [boundaries_markdown(report) for report in reports
                 if report.get("benchmark") == "bench_boundaries"]
    return "\n\n".join(sections)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="results.json")
    args = parser.parse_args(argv)
    text = markdown([load(p) for p in args.paths])
    if not text:
        sys.exit("no benchmark results in " + ", ".join(args.paths))
    print(text)
    return text


if __name__ == "__main__":
    main()
