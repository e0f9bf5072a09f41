"""Structured output on the default model, SmolLM2-135M-Instruct (a real 49k-token BPE
vocabulary, through turbo): every schema of ``tests.helpers.json_schemas`` at
temperature 1, each answer parsed and validated by ``jsonschema``, and a Lark grammar's
answer parsed by the lark library."""

from __future__ import annotations

import json

import jsonschema
import lark

from llmctl import LLM, SamplingParams
from llmctl.engine.sampling_params import StructuredOutput
from tests.helpers.json_schemas import SCHEMAS

LARK = 'start: "(" WORD ("," WORD)~0..3 ")"\nWORD: /[a-z]{1,8}/'


def test_every_schema_validates_on_the_default_model(smollm2) -> None:
    names = list(SCHEMAS)
    params = [
        SamplingParams(
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            structured=StructuredOutput("json_schema", json.dumps(SCHEMAS[name])),
        )
        for seed, name in enumerate(names)
    ]
    lark_params = SamplingParams(
        max_tokens=60, temperature=1.0, seed=0, structured=StructuredOutput("lark", LARK)
    )
    with LLM(backend="turbo", session_len=512, cache_max_entry_count="64", dtype="float32") as llm:
        outputs = llm.chat(
            [[{"role": "user", "content": f"Reply in JSON ({name})."}] for name in names]
            + [[{"role": "user", "content": "Name a few fruits."}]],
            params + [lark_params],
        )
    for name, output in zip(names, outputs):
        assert output.finish_reason == "stop", (name, output.text)
        jsonschema.validate(json.loads(output.text), SCHEMAS[name])
    lark.Lark(LARK).parse(outputs[-1].text)
