"""The DSI heat map: speedup over plain decoding by drafter cost ratio c and acceptance rate a (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import numpy as np  # noqa: E402


def heatmap(cells: list[dict], points: list[dict], out: str | Path, *, servers: int) -> Path:
    """Three panels over the (c, a) grid of ``cells`` (`draftsmith.sim.dsi.grid`): SI over plain (the line
    marks 1.0: SI slower than plain below-right of it), DSI over plain, DSI over SI; ``points`` (dicts with
    name, c, a) are marked on each."""
    cs = sorted({c["c"] for c in cells})
    accs = sorted({c["a"] for c in cells})
    idx = {(c["c"], c["a"]): c for c in cells}

    def mat(key):
        return np.array([[idx[(c, a)][key] for c in cs] for a in accs])

    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.2), constrained_layout=True)
    panels = [("si_over_plain", "SI / plain"), ("dsi_over_plain", f"DSI ({servers} target instances) / plain"),
              ("dsi_over_si", "DSI / SI")]
    for ax, (key, title) in zip(axes, panels):
        m = mat(key)
        # colours capped at 3x (a few cells near c = 0, a = 1 reach tens): the 1.0x line is what matters
        im = ax.pcolormesh(cs, accs, m, shading="nearest", cmap="RdYlGn", norm=matplotlib.colors.TwoSlopeNorm(
            vmin=min(0.5, float(m.min())), vcenter=1.0, vmax=3.0))
        cont = ax.contour(cs, accs, m, levels=[1.0], colors="black", linewidths=1.2)
        ax.clabel(cont, fmt="1.0x", fontsize=8)
        for i, p in enumerate(points):
            ax.plot(p["c"], p["a"], "o", ms=6, mfc="white", mec="black")
            ax.annotate(p["name"], (p["c"], p["a"]), textcoords="offset points", xytext=(6, 10 - 14 * (i % 3)),
                        fontsize=7)
        ax.set_xlabel("drafter cost ratio c (drafter forward / target forward)")
        ax.set_ylabel("acceptance rate a")
        ax.set_title(title + " (simulated)", fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.85, extend="max")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return out
