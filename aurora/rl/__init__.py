"""RL post-training: models, tasks, rollout engines and learners.

* `aurora.rl.types` — the data contract (`Prompt`, `Sample`, `Completion`), no torch;
* `aurora.rl.model` — Hugging Face causal LMs (built locally, or a directory) and the `Tokenizer`;
* `aurora.rl.tasks` — tasks with verifiable rewards;
* `aurora.rl.algos` — GRPO's pure pieces (group advantages, clipped surrogate, KL);
* `aurora.rl.engines` — rollout engines under one verified-apply contract (torch, vllm, synthetic);
* `aurora.rl.learners` — learners that turn accepted results into versions (grpo, synthetic).

Their configuration is `aurora.config.rl`. Nothing here imports `aurora.actors` or
`aurora.transport`: the nodes use RL, not the other way round.
"""
