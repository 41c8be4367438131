"""EAGLE-3 drafters (arXiv 2503.01840; docs/methods.md section 13): one decoder layer over the target's fused
low, middle and high states, trained with the training-time test, drafting over a pruned vocabulary."""
