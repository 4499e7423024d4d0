"""Evaluation: lm-eval through the CDB engine (`eval.lm`, model "looped"), the lm-eval-compatible
CLI (`python -m eval`), local tasks built from held-out text (eval/tasks), and sweeps pairing
accuracy with engine throughput over exit threshold x r_min x KV layout x lookahead (`eval.sweep`)."""
