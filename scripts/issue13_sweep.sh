#!/usr/bin/env bash
# Issue 13 (parts 1-3, 5) figures on the default target: divergences side by side, kept-vocabulary sizes with
# and without RDK, ours vs HF assisted with the same drafter, the HF export's greedy equality. All variants
# train on the same data and for the same steps (shared_data: runs/standalone-data).
# Times on this 2-core CPU with nothing else running (2 threads): data ~3 min, cache ~1 min, each training
# ~8 min (2 epochs, a 2-layer drafter), report ~1 min each. Tables: see the comments at the bottom.
set -euo pipefail
DS=.venv/bin/draftsmith
PY=.venv/bin/python

# 1. Data and cache once, then the forward-KL drafter (also the 100%-vocabulary row).
$DS run standalone name=sa-fkl
# 2. The other divergences, same data, same steps.
for d in rkl tvd jsd; do $DS run standalone name=sa-$d drafter.divergence=$d; done
# 3. Kept vocabularies: 50, 25, 10, 5 percent, each with an RDK map (one checkpoint decodes both ways).
for k in 0.50 0.25 0.10 0.05; do $DS run standalone-pruned name=sp-${k#0.} drafter.vocab_keep=$k; done
# Offline alpha on the 80 MT-Bench first-turn answers of the target (held-out cache), renormalised vs RDK:
#   expected_acceptance / expected_acceptance_rdk in runs/sp-*/report.md and runs/sa-*/report.md

# 4. Decoding tables (one interleaved run each). Divergences + ours vs HF assisted (same drafter, same K),
#    greedy and T=1; at T=0 the '= plain' / '= HF generate' columns count outputs equal to greedy decoding.
#    11 methods x 80 prompts x 128 tokens: ~3 h here; --prompts 24 --max-new-tokens 96 takes ~40 min.
$PY -m draftsmith.eval.standalone_table runs/sa-fkl/final runs/sa-rkl/final runs/sa-tvd/final runs/sa-jsd/final \
    --hf-assisted --prompts 80 --max-new-tokens 128 --temperature 0 1 --draft-len 4 --out runs/issue13-divergences
# Kept sizes, renormalised vs RDK, draft time per token and tokens/s (the full head is sa-fkl):
$PY -m draftsmith.eval.standalone_table runs/sa-fkl/final runs/sp-50/final runs/sp-25/final runs/sp-10/final \
    runs/sp-05/final --prompts 80 --max-new-tokens 128 --temperature 0 1 --draft-len 4 --out runs/issue13-vocab
# 5. The HF export's greedy equality on all 80 first turns (HF assisted vs HF generate, ~1.5 h):
$DS export runs/sa-fkl/final --to hf --out runs/sa-fkl-hf
$PY -m draftsmith.eval.standalone_table runs/sa-fkl/final --hf-export runs/sa-fkl-hf --prompts 80 \
    --max-new-tokens 128 --temperature 0 --out runs/issue13-hf-greedy
