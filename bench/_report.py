"""The table and the targets (issue #6) of one benchmark run, from its results dict."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["report"]

MB = 1e6

LABELS = {
    "ours_full": "ours: full torch_dist",
    "ours_trainable": "ours: trainable-only (adapter + Adam state)",
    "ours_model_only": "ours: adapter only (no optimizer, no RNG)",
    "bare_full": "DCP write of our full entries (no manifest/checksums/commit)",
    "bare_trainable": "DCP write of our trainable entries (no manifest/checksums/commit)",
    "s3_trainable": "ours: trainable-only to s3:// (local moto server: data streamed in parts / load by ranged reads)",
    "s3_plain": "plain s3fs put / get of the same files, all in flight at once (same server; no protocol)",
    "plain_dcp": "plain DCP: get_state_dict(ignore_frozen_params) + dcp.save/load",
    "torch_save": "torch.save of the filtered state dict (no fsync)",
    "torch_save_fsync": "torch.save of the filtered state dict + fsync",
    "hf_peft": "HF PEFT save_pretrained (no fsync)",
    "hf_peft_fsync": "HF PEFT save_pretrained + fsync / PeftModel.from_pretrained",
}


def _m(entry: dict[str, Any] | None) -> float:
    return float("nan") if entry is None else float(entry["median_s"])


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return ""
    return f"{entry['median_s']:.3f} [{entry['min_s']:.3f}-{entry['max_s']:.3f}]"


def _bw(nbytes: int, entry: dict[str, Any] | None) -> str:
    if entry is None or not entry["median_s"]:
        return ""
    return f"{nbytes / MB / entry['median_s']:.0f}"


def _target(name: str, value: float, limit: float, op: str, detail: str) -> dict[str, Any]:
    met = (value <= limit) if op == "<=" else (value >= limit)
    return {"target": name, "value": value, "limit": limit, "op": op,
            "met": bool(met) if not math.isnan(value) else None, "detail": detail}


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    rows, raw = r["rows"], r["raw"]
    full, tr, mo = rows["ours_full"], rows["ours_trainable"], rows["ours_model_only"]
    out = [
        _target("trainable-only save <= plain DCP save (same adapter + optimizer)",
                _m(tr["save"]) / _m(rows["plain_dcp"]["save"]), 1.0, "<=",
                f"{tr['bytes'] / MB:.1f} MB vs {rows['plain_dcp']['bytes'] / MB:.1f} MB"),
    ]
    if "hf_peft_fsync" in rows:
        hf = rows["hf_peft_fsync"]
        out.append(_target("adapter-only save <= HF PEFT save_pretrained + fsync (model only, like for like)",
                           _m(mo["save"]) / _m(hf["save"]), 1.0, "<=",
                           f"{mo['bytes'] / MB:.1f} MB vs {hf['bytes'] / MB:.1f} MB"))
        out.append(_target("trainable-only save (adapter + Adam) <= HF PEFT model-only save + fsync",
                           _m(tr["save"]) / _m(hf["save"]), 1.0, "<=",
                           f"{tr['bytes'] / MB:.1f} MB vs {hf['bytes'] / MB:.1f} MB"))
    out += [
        _target("trainable-only save <= 1.5x raw write+fsync of its bytes",
                _m(tr["save"]) / _m(raw["trainable"]["write"]), 1.5, "<=", f"{tr['bytes'] / MB:.1f} MB"),
        _target("full save bandwidth >= 0.9x raw write+fsync bandwidth",
                _m(raw["full"]["write"]) / _m(full["save"]), 0.9, ">=", f"{full['bytes'] / MB:.0f} MB"),
        _target("full load bandwidth (checksums verified while reading, the default) >= 0.9x raw read bandwidth",
                _m(raw["full"]["read"]) / _m(full["load"]), 0.9, ">=", f"page cache: {r['cache']}"),
        _target("full load bandwidth (--no-verify-checksums) >= 0.95x raw read bandwidth",
                _m(raw["full"]["read"]) / _m(full["load_noverify"]), 0.95, ">=", f"page cache: {r['cache']}"),
        _target("async trainable-only save: blocked <= 1% of the sync save",
                _m(r["async"]["trainable"]["blocked"]) / _m(tr["save"]), 0.01, "<=", ""),
    ]
    if "full" in r["async"]:
        out.append(_target("async full save: blocked <= 1% of the sync save",
                           _m(r["async"]["full"]["blocked"]) / _m(full["save"]), 0.01, "<=", ""))
    if "train_loop" in r:
        tl = r["train_loop"]
        out.append(_target("training step with a checkpoint every step (--save-interval 1 --async-save) <= 1.02x "
                           "the step without saves", _m(tl["every_step_async"]) / _m(tl["no_saves"]), 1.02, "<=",
                           f"medians; {tl['checkpoints_committed']} checkpoints committed"))
    if "s3_plain" in rows:
        s3, plain = rows["s3_trainable"], rows["s3_plain"]
        out.append(_target("save to S3 bandwidth >= 0.8x a plain parallel put of the same bytes (same server)",
                           _m(plain["save"]) / _m(s3["save"]), 0.8, ">=", f"{s3['bytes'] / MB:.1f} MB"))
        out.append(_target("load from S3 bandwidth >= 0.8x a plain parallel get of the same bytes (same server)",
                           _m(plain["load"]) / _m(s3["load"]), 0.8, ">=", f"{s3['bytes'] / MB:.1f} MB"))
        if "s3_plain_ranged_load" in r:  # the same request pattern: what the protocol adds, not the server's ranges
            out.append(_target("load from S3 bandwidth >= 0.8x plain ranged GETs of the same parts (same server)",
                               _m(r["s3_plain_ranged_load"]) / _m(s3["load"]), 0.8, ">=",
                               f"{s3['bytes'] / MB:.1f} MB"))
    fit = r.get("scaling", {}).get("fit", {}).get("ours")
    if fit is not None:
        raw = r["scaling"]["fit"].get("raw_write")
        out.append(_target("cost per stored tensor (trainable-only save, scaling fit) <= 25 us",
                           fit["per_tensor_s"] * 1e6, 25.0, "<=", "microseconds" + (
                               f"; {raw['per_tensor_s'] * 1e6:.0f} of them the raw write + fsync of its bytes"
                               if raw else "")))
    # A full save computes no fingerprint (only trainable-only saves record one, computed once per run),
    # so what checksums + fingerprint add to a full save is what our save costs over the bare DCP write of
    # the same entries (manifest, streamed checksums, commit protocol).
    added = _m(full["save"]) / _m(rows["bare_full"]["save"]) - 1
    checks, fp = _m(full["checksum"]), _m(r["fingerprint"])
    out.append(_target("checksums + base fingerprint add <= 10% to a full save", added, 0.1, "<=",
                       f"full save over the bare DCP write of its entries; hashing alone, standalone, would be "
                       f"{checks / _m(full['save']):.0%} of the save; a full save computes no fingerprint"))
    out.append(_target("base fingerprint (once per run, first trainable-only save or load) <= 10% of a full save",
                       fp / _m(full["save"]), 0.1, "<=", f"{r['numel']['frozen'] / 1e6:.0f}M frozen elements, "
                       f"chunk kernel {r.get('fingerprint_kernel', 'int_mm')}"))
    return out


def report(r: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Markdown text (table, extra measurements, targets) and the target records."""
    rows, raw = r["rows"], r["raw"]
    lines = [
        f"model: {r['model']['num_layers']} layers x {r['model']['hidden_size']} hidden, "
        f"{(r['numel']['frozen'] + r['numel']['trainable']) / 1e6:.0f}M parameters "
        f"({r['numel']['trainable'] / 1e6:.2f}M trainable); layout {r['layout']}; {r['repeats']} repeats; "
        f"reads: page cache `{r['cache']}`; run took {r.get('wall_s', float('nan')):.0f} s, peak RSS "
        f"{max(r.get('peak_rss_gib', {}).values(), default=float('nan')):.1f} GiB",
        "",
        "| what | MB | save s, median [min-max] | save MB/s | load s, median [min-max] | load MB/s |",
        "|---|---:|---|---:|---|---:|",
    ]
    for key, label in LABELS.items():
        if key not in rows:
            continue
        row = rows[key]
        load = row.get("load")
        lines.append(f"| {label} | {row['bytes'] / MB:.1f} | {_cell(row['save'])} | {_bw(row['bytes'], row['save'])} "
                     f"| {_cell(load)} | {_bw(row['bytes'], load)} |")
        if "load_verify_first" in row:
            lines.append(f"| &nbsp;&nbsp;same, every file verified before the read (verify_while_reading=False) | | | | "
                         f"{_cell(row['load_verify_first'])} | {_bw(row['bytes'], row['load_verify_first'])} |")
        if "load_noverify" in row:
            lines.append(f"| &nbsp;&nbsp;same, loaded with --no-verify-checksums | | | | "
                         f"{_cell(row['load_noverify'])} | {_bw(row['bytes'], row['load_noverify'])} |")
    for name, rec in raw.items():
        lines.append(f"| raw sequential write+fsync / read, {name} bytes | {rec['bytes'] / MB:.1f} | "
                     f"{_cell(rec['write'])} | {_bw(rec['bytes'], rec['write'])} | {_cell(rec['read'])} | "
                     f"{_bw(rec['bytes'], rec['read'])} |")
    lines += ["", "| also measured | s, median [min-max] |", "|---|---|"]
    for name, rec in r["async"].items():
        lines.append(f"| async {name} save: training blocked | {_cell(rec['blocked'])} |")
        lines.append(f"| async {name} save: call to committed (`wait()`) | {_cell(rec['until_committed'])} |")
    lines.append(f"| base fingerprint (uncached; once per run) | {_cell(r['fingerprint'])} |")
    if "s3_trainable" in rows:
        s3, local = rows["s3_trainable"], rows["ours_trainable"]
        lines.append(f"| trainable-only on S3 / on local disk (medians): save x{_m(s3['save']) / _m(local['save']):.2f}, "
                     f"load x{_m(s3['load']) / _m(local['load']):.2f} | |")
    for name, counts in r.get("s3_requests", {}).items():
        lines.append(f"| S3 requests of one trainable-only {name} (by operation, server's log) | "
                     + ", ".join(f"{op} {k}" for op, k in counts.items()) + " |")
    if "s3_load_bytes" in r:
        lb = r["s3_load_bytes"]
        lines.append("| S3 load: bytes fetched per rank (ranged GETs) / the checkpoint's bytes | "
                     + ", ".join(f"{b / lb['checkpoint']:.3f}" for b in lb["fetched_per_rank"])
                     + f" (of {lb['checkpoint'] / 1e6:.1f} MB) |")
    if "base_from_store" in r:
        bs = r["base_from_store"]
        lines.append(f"| a base ({bs['bytes'] / MB:.0f} MB, {bs['layers']} layers x {bs['hidden']}) loaded before the "
                     f"first step (`load_pretrained`), from local disk | {_cell(bs['local'])} |")
        for key, label in (("store_first_run", "a host's first run (fetched whole into the base cache)"),
                           ("store_cached", "a later run (read from the base cache)"),
                           ("store_ranged", "`--no-base-cache` (ranged reads)")):
            lines.append(f"| &nbsp;&nbsp;from S3, {label}: x{_m(bs[key]) / _m(bs['local']):.2f} the local load, "
                         f"{(bs[key]['bytes_fetched'] or 0) / MB:.0f} MB fetched | {_cell(bs[key])} |")
    lines.append(f"| checksums of the full checkpoint's files (standalone) | {_cell(rows['ours_full']['checksum'])} |")
    if "train_loop" in r:
        tl = r["train_loop"]
        for mode, label in (("no_saves", "no saves"), ("every_step_async", "`--save-interval 1 --async-save`")):
            lines.append(f"| training step, LoRA run, {label} ({tl['rounds']} runs x {tl['iters']} iterations) | "
                         f"{_cell(tl[mode])} |")
    sc = r["scaling"]
    lines += ["", "Scaling (trainable-only save; stored tensors = adapter tensors x 3 with the Adam moments):", "",
              "| layers | adapter tensors | MB | ours s | plain DCP s | raw write + fsync s |",
              "|---:|---:|---:|---|---|---|"]
    for p in sc["points"]:
        lines.append(f"| {p['layers']} | {p['adapter_tensors']} | {p['bytes'] / MB:.1f} | {_cell(p['ours'])} | "
                     f"{_cell(p['plain_dcp'])} | {_cell(p['raw_write']) if 'raw_write' in p else '-'} |")
    for who, fit in sc["fit"].items():
        lines.append(f"\nfit {who}: {fit['fixed_s'] * 1e3:.1f} ms fixed + {fit['per_tensor_s'] * 1e6:.0f} us per "
                     "stored tensor")
    if "raw_write" in sc["fit"]:
        own = sc["fit"]["ours"]["per_tensor_s"] - sc["fit"]["raw_write"]["per_tensor_s"]
        lines.append(f"\nof ours per stored tensor: the raw write of its bytes "
                     f"{sc['fit']['raw_write']['per_tensor_s'] * 1e6:.0f} us (the disk), framing + checksums + "
                     f"commit {own * 1e6:.0f} us")
    tg = targets(r)
    lines += ["", "| target | ratio | limit | met |", "|---|---:|---:|---|"]
    for t in tg:
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
        detail = f" ({t['detail']})" if t["detail"] else ""
        lines.append(f"| {t['target']}{detail} | {t['value']:.3f} | {t['op']} {t['limit']} | {met} |")
    if "hf_peft" in rows and not rows["hf_peft"]["same_adapter"]:
        lines.append("\nnote: a fused LoRA target has no HF equivalent; HF PEFT adapts the parts instead.")
    return "\n".join(lines), tg
