"""Text rendering of :mod:`peftckpt.checkpoint.tools.inspect` reports (``peftckpt inspect`` without ``--json``)."""

from __future__ import annotations

from peftckpt.checkpoint.location.names import TRACKER_FILENAME
from peftckpt.checkpoint.state.sections import MODEL, OPTIMIZER, RNG_STATE
from peftckpt.checkpoint.tools.inspect import (
    CheckpointReport,
    InspectReport,
    KeyRecord,
)

__all__ = ["render_text"]

_SECTION_ORDER = (MODEL, OPTIMIZER, RNG_STATE)
_LAYOUT_ORDER = {"tp": 0, "pp": 1, "dp": 2, "vpp": 3}


# ------------------------------------------------------------------------------------------- render


def _human(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "?"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{num_bytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _trainable_text(rec: KeyRecord) -> str:
    if rec.trainable is None:
        return "-"
    if not rec.saved:
        return "frozen (not saved)"
    return "yes" if rec.trainable else "frozen"


def _key_table(keys: dict[str, KeyRecord]) -> list[str]:
    by_section: dict[str, list[str]] = {}
    for key in sorted(keys):
        by_section.setdefault(keys[key].section, []).append(key)
    order = [s for s in _SECTION_ORDER if s in by_section] + sorted(set(by_section) - set(_SECTION_ORDER))
    header = ("key", "shape", "dtype", "bytes", "trainable")
    rows = {k: (k, "object" if r.kind == "object" else str(r.shape), r.dtype or "-",
                f"{r.size_bytes:,}" if r.nbytes is not None or r.stored_bytes is not None else "?",
                _trainable_text(r)) for k, r in keys.items()}
    widths = [max(len(header[i]), *(len(row[i]) for row in rows.values())) for i in range(len(header))]

    def fmt(row: tuple[str, ...]) -> str:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]),
                 row[3].rjust(widths[3]), row[4]]
        return "    " + "  ".join(cells)

    lines = ["", fmt(header)]
    for section in order:
        names = by_section[section]
        total = sum(keys[k].size_bytes for k in names if keys[k].saved)
        absent = sum(1 for k in names if not keys[k].saved)
        extra = f", {absent} not saved" if absent else ""
        lines.append(f"  [{section}] {len(names)} key(s){extra}, {_human(total)} saved")
        lines.extend(fmt(rows[k]) for k in names)
    return lines


def _key_counts(keys: dict[str, KeyRecord]) -> str:
    model = [r for r in keys.values() if r.section == MODEL]
    optim = [r for r in keys.values() if r.section == OPTIMIZER]
    other = len(keys) - len(model) - len(optim)
    saved = sum(1 for r in model if r.saved)
    parts = [f"{saved} model" + (f" (+{len(model) - saved} frozen, not saved)" if saved < len(model) else ""),
             f"{len(optim)} optimizer", f"{other} other"]
    return ", ".join(parts) if keys else "none"


def _checkpoint_lines(ckpt: CheckpointReport, show_keys: bool) -> list[str]:
    state = ckpt.state if ckpt.loadable else f"{ckpt.state.upper()} (not loadable)"
    if ckpt.checksums_verified:
        state += f", checksums verified (all {ckpt.sizes.num_files} files)" if ckpt.loadable else \
            " (checksums checked)"
    fmt = ckpt.format or "unknown"
    if ckpt.format_version is not None:
        fmt += f" (format version {ckpt.format_version}, peftckpt {ckpt.library_version}, saved {ckpt.created_at})"
    layout = "?" if ckpt.layout is None else " ".join(
        f"{k}={ckpt.layout[k]}" for k in sorted(ckpt.layout, key=lambda k: (_LAYOUT_ORDER.get(k, 9), k)))
    s = ckpt.sizes
    if s.trainable_bytes is None:
        sizes = f"model {_human(s.model_bytes)} saved (no manifest: full size and trainable part unknown)"
    else:
        sizes = f"full model {_human(s.model_bytes)}"
        fraction = s.trainable_fraction
        pct = "" if fraction is None else f" ({100 * fraction:.2f}%)"
        sizes += f", trainable {_human(s.trainable_bytes)}{pct}, saved model {_human(s.saved_model_bytes)}"
    sizes += (f", optimizer {_human(s.optimizer_bytes)}, "
              f"other {_human(s.other_bytes)}; on disk {_human(s.disk_bytes)} in {s.num_files} files")
    keys_line = _key_counts(ckpt.keys)
    rows = [
        ("checkpoint", str(ckpt.path)), ("state", state), ("format", fmt),
        ("iteration", "?" if ckpt.iteration is None else str(ckpt.iteration)), ("layout", layout),
        ("trainable_only", "?" if ckpt.trainable_only is None else str(ckpt.trainable_only).lower()),
        ("fingerprint", ckpt.base_fingerprint or "-"), ("sections", ", ".join(ckpt.sections) or "?"),
        ("sizes", sizes), ("keys", keys_line + ("" if show_keys or not ckpt.keys else "  (--keys for the table)")),
    ]
    lines = [f"{k:<15}{v}" for k, v in rows]
    lines += [f"{'refused':<15}{r['file']}: {r['message']}" for r in ckpt.refused]
    lines += [f"{'problem' if not ckpt.loadable else 'note':<15}{r}" for r in ckpt.reasons]
    lines += [f"{'note':<15}{n}" for n in ckpt.notes]
    if show_keys and ckpt.keys:
        lines += _key_table(ckpt.keys)
    return lines


def render_text(report: InspectReport, show_keys: bool = False) -> str:
    """The human-readable report: save directory listing, header, size summary, optional key table."""
    lines: list[str] = []
    if report.save_dir is not None:
        sd = report.save_dir
        tracker = sd.tracker_error or ("none" if sd.tracker is None else str(sd.tracker))
        lines.append(f"{'save directory':<15}{sd.path} ({TRACKER_FILENAME}: {tracker})")
        width = max((len(e.name) for e in sd.entries), default=0)
        for e in sd.entries:
            mark = "  <- selected" if e.selected else ""
            reason = f"  {e.reason}" if e.reason and not e.selected else ""
            lines.append(f"  {e.name:<{width}}  {e.state}{mark}{reason}")
        lines += [f"{'note':<15}{n}" for n in sd.notes]
        if report.checkpoint is None:
            lines += [f"{report.state.upper():<15}{r}" for r in report.reasons]
        lines.append("")
    if report.checkpoint is not None:
        lines += _checkpoint_lines(report.checkpoint, show_keys)
    return "\n".join(lines).rstrip("\n") + "\n"
