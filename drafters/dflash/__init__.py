"""DFlash drafters (arXiv 2602.06036; docs/methods.md section 18): a block of mask tokens after the newest token,
drafted in one non-causal forward over the target's fused context states."""
