"""Training: binary RL and OPD from hindsight hints under torchrun (FSDP2), as a recipe.

Pure math: `advantages` (RL, group-normalized, OPD, combined, staleness) and `loss` (PPO clip,
dual clip, TIS, k3 KL, aggregations, chunked logprobs); `objective` assembles them once from
config. Data: `batch` (samples, collation), `teacher` (hint-augmented prompts), `plan` (items,
steps). Run: `recipe` (the torchrun program), `scoring`, `optim`, `distributed` (FSDP2),
`checkpoint`, `lora`, `flops`; `launch` starts it as a subprocess.
"""
