"""Structured output on turbo: the grammar lives in the shared sampler, so turbo's own
step feeds it the same way; every answer validates with ``jsonschema``."""

from __future__ import annotations

import json

import jsonschema

from llmctl import LLM, SamplingParams
from llmctl.engine.sampling_params import StructuredOutput
from tests.helpers.json_schemas import SCHEMAS


def test_every_schema_validates_on_turbo(turbo_ops) -> None:
    names = list(SCHEMAS)
    params = [
        SamplingParams(
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            structured=StructuredOutput("json_schema", json.dumps(SCHEMAS[name])),
        )
        for seed, name in enumerate(names)
    ]
    with LLM("demo", backend="turbo", device="cpu") as llm:
        outputs = llm.generate(["Answer in JSON:"] * len(names), params)
    for name, output in zip(names, outputs):
        jsonschema.validate(json.loads(output.text), SCHEMAS[name])
