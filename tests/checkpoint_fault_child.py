"""Child process of the checkpoint fault test: a checkpointed generation SIGKILLed at filesystem operation k.

Usage: python checkpoint_fault_child.py MODEL_DIR CKPT_DIR KILL_AT MAX_TOKENS EVERY
KILL_AT 0 never kills; the process then prints the operation count and the tokens as JSON.
"""

import json
import os
import signal
import sys

import mlx_infer.generation.checkpoint_store as store
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import prompt_ids_for
from mlx_infer.generation.checkpoint import generate_checkpointed
from mlx_infer.sampling import SamplingParams

model_dir, ckpt, kill_at, max_tokens, every = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
ops = []


def hook(name: str) -> None:
    ops.append(name)
    if len(ops) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)


store.fault_hook = hook
loaded = load_model(model_dir)
gen = generate_checkpointed(loaded, prompt_ids_for(loaded, "Hello"), ckpt, sampling=SamplingParams(temperature=0.8, seed=3),
                            max_tokens=max_tokens, every=every)
with gen:
    tokens = [t.token for t in gen]
print(json.dumps({"ops": ops, "tokens": tokens}))
