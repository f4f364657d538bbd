"""Scoring prompts: the log-probability of every prompt token (`prompt_logprobs`, OpenAI's
`echo` + `logprobs`), kept beside the prefix cache's blocks so a scored prompt whose context
is cached is not computed again (`store.py`)."""
