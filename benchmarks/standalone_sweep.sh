#!/usr/bin/env bash
# Standalone-drafter figures on the default target (docs/results-log.md sections 5 and 6, docs/rdk.md): divergences side
# by side, kept-vocabulary sizes with and without RDK, ours vs HF assisted generation with the same drafter,
# the HF export's greedy equality, a drafter with its own tokenizer. All variants train on the same data and
# for the same steps (the recipes' shared_data directory, runs/standalone-data).
# Times on a 2-core CPU with nothing else running (2 threads): data ~3 min, cache ~1 min, each training
# ~8 min (2 epochs, a 2-layer drafter), report ~1 min each.
#     bash benchmarks/standalone_sweep.sh      (from anywhere: it runs from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."  # `python -m benchmarks.NAME` needs the repository root (benchmarks/ is not installed)
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

# 4. Decoding tables (one interleaved run each; docs/results-log.md section 5). Every drafter side by
#    side with HF assisted generation at the same K, greedy and T=1 (~55 min at 1 thread); draft time per
#    drafted token by kept size (~5 min); the RDK map constructions and their ceilings (~12 min).
$PY -m benchmarks.standalone_table runs/sa-fkl/final runs/sa-rkl/final runs/sa-tvd/final runs/sa-jsd/final \
    runs/sp-50/final runs/sp-25/final runs/sp-10/final runs/sp-05/final --hf-assisted --prompts 12 \
    --max-new-tokens 64 --temperature 0 1 --draft-len 4 --out runs/standalone-table12
$PY -m benchmarks.draft_time runs/sa-fkl/final runs/sp-50/final runs/sp-25/final runs/sp-10/final \
    runs/sp-05/final --out runs/standalone-probes/draft_time.json
$PY -m benchmarks.rdk_probe runs/sp-05/final --data runs/standalone-data \
    --variant conditional:16:1.0 column:16:1.0 column:16:0.3 --dense --out runs/standalone-probes/rdk_probe_05.json
# 5. The HF export's greedy equality on all 80 first turns (HF assisted vs HF generate, 53 min at 1 thread):
$DS export runs/sa-fkl/final --to hf --out runs/sa-fkl-hf
$PY -m benchmarks.standalone_table runs/sa-fkl/final --hf-export runs/sa-fkl-hf --prompts 80 \
    --max-new-tokens 128 --temperature 0 --out runs/standalone-hf-greedy
# 6. A standalone drafter that pays off: the same recipe on the hydra-xl data (docs/results-log.md section 2), K=1..3.
$DS run standalone-pruned name=sp-xl shared_data=runs/hydra-xl-data drafter.vocab_keep=0.05 \
    drafter.divergence=jsd train.max_steps=1000 threads=1
$PY -m benchmarks.standalone_table runs/sp-xl/final --hf-assisted --no-rdk --draft-len 1 2 3 --prompts 12 \
    --max-new-tokens 96 --temperature 0 1 --out runs/standalone-spxl
# 7. Own tokenizer: TLI and SLEM vs HF universal assisted generation (~25 min train, 38 min bench).
$DS run own-tokenizer
$PY -m benchmarks.own_tokenizer_bench runs/own-tokenizer/final --prompts 24 --max-new-tokens 128 \
    --draft-len 4 --temperature 0 0.7 --threads 1 --out runs/own-tokenizer/eval24
