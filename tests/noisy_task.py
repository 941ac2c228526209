"""A task that prints while it loads, as Hugging Face models do: text, a line that looks like a
result, and bytes that are not UTF-8 - none of it may change what a fresh process hands back."""

import dataclasses
import sys

from tests.own_task import task as _quiet


def _say(text: str) -> None:
    print(text, flush=True)
    sys.stdout.buffer.write(b"\xff\xfe not utf-8 \x80\n")
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)


_say('Loading checkpoint shards: 100%|##########| 2/2\n{"identical": false, "error": "forged"}')


def _build_model():
    _say("Some weights of the model were not initialized from the checkpoint")
    return _quiet.build_model()


task = dataclasses.replace(_quiet, name="noisy-points", build_model=_build_model)
