"""Grammar-constrained decoding: xgrammar tables from llmctl's own tokenizers, compiles
cached and refused by name, and the engine's outputs following their grammar exactly
(validated by ``jsonschema`` and ``re``), in mixed batches, with preemption, at
temperature 1."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from llmctl.engine.config import SpeculativeConfig
from llmctl.engine.grammar import GrammarCompiler, GrammarState
from llmctl.engine.sampling_params import SamplingParams, StructuredOutput
from llmctl.errors import InvalidRequest
from tests.helpers.json_schemas import SCHEMAS
from tests.helpers.paged_toy_model import make_engine, run
from tests.helpers.trained_tokenizers import trained


def json_schema(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


# Text with every character the schemas below need, for the BPE tokenizers trained here.
JSON_CORPUS = [json.dumps({"abc": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1.5e3, True, False, None]})] * 5
JSON_CORPUS += ['{"x": "a-b c", "AZ": "xyz"}', "Once upon a time, the end."] * 5


@pytest.fixture(params=["stories260K", "byte_level_bpe", "metaspace_bpe"])
def tokenizer(request, stories_tokenizer):
    if request.param == "stories260K":
        return stories_tokenizer
    kind = "byte_level" if request.param == "byte_level_bpe" else "metaspace"
    return trained(kind, JSON_CORPUS)


def random_walk(compiler: GrammarCompiler, spec: StructuredOutput, tokenizer, seed: int) -> str:
    """Pick uniformly among the tokens the grammar allows until it ends; the text."""
    import xgrammar as xgr

    state = GrammarState(compiler.compiled(spec))
    bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    rng = random.Random(seed)
    ids = []
    for _ in range(400):
        state.fill(bitmask, 0)
        words = bitmask[0].tolist()
        allowed = [i for i in range(compiler.vocab_size) if (words[i // 32] >> (i % 32)) & 1]
        # Prefer stopping once allowed, so strings stay short on any vocabulary.
        stops = [i for i in allowed if i in tokenizer.eos_token_ids]
        token = stops[0] if stops and rng.random() < 0.5 else rng.choice(allowed)
        assert state.accept(token)
        if state.finished:
            return tokenizer.decode(ids)
        ids.append(token)
    raise AssertionError(f"the grammar did not end in 400 tokens: {tokenizer.decode(ids)!r}")


def test_every_tokenizer_kind_follows_regex_and_schema(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    pattern = r"[a-c]{2,4}-[0-9]{1,3}( end)?"
    for seed in range(5):
        text = random_walk(compiler, StructuredOutput("regex", pattern), tokenizer, seed)
        assert re.fullmatch(pattern, text), text
    for name in ("enum", "bounded_array", "refs"):
        text = random_walk(compiler, json_schema(SCHEMAS[name]), tokenizer, seed=1)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


# Lark grammars (xgrammar reads them itself), checked by the lark library's own parser.
LARK_GRAMMARS = {
    "nested lists": (
        'start: "[" [item ("," item)~0..3] "]"\n'
        "item: NUMBER | WORD | inner\n"
        'inner: "[" [NUMBER ("," NUMBER)~0..2] "]"\n'
        "NUMBER: /-?[0-9]{1,3}/\n"
        "WORD: /[a-c]{1,4}/"
    ),
    "imports and ignore": (
        'start: pair ("," pair)~0..2\n'
        'pair: WORD ":" SIGNED_NUMBER\n'
        "WORD: /[a-z]{1,5}/\n"
        "%import common.SIGNED_NUMBER\n"
        "%import common.WS_INLINE\n"
        "%ignore WS_INLINE"
    ),
    "ranges and inlined rules": (
        '?start: greeting | number\ngreeting: ("a".."c")~2 " xyz"\nnumber: DIGIT~1..3\n'
        "%import common.DIGIT"
    ),
}


def test_every_tokenizer_kind_follows_lark_grammars(tokenizer) -> None:
    import lark

    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    for grammar in LARK_GRAMMARS.values():
        parser = lark.Lark(grammar, parser="earley")
        for seed in range(4):
            text = random_walk(compiler, StructuredOutput("lark", grammar), tokenizer, seed)
            parser.parse(text)  # raises if the text is not in the grammar's language


def test_compiles_are_cached_by_spec(stories_tokenizer) -> None:
    compiler = GrammarCompiler(stories_tokenizer, 512, (2,))
    first = compiler.compile(json_schema(SCHEMAS["flat"]))
    assert compiler.compile(json_schema(SCHEMAS["flat"])) is first
    assert compiler.compile(json_schema(SCHEMAS["enum"])) is not first


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutput("json_schema", '{"type": "object"'), "not JSON"),
        (StructuredOutput("json_schema", '{"type": "strange"}'), "does not compile"),
        (json_schema({"type": "object", "not": {"required": ["a"]}}), "'not' at /"),
        (json_schema({"type": "array", "uniqueItems": True}), "'uniqueItems' at /"),
        (json_schema({"properties": {"n": {"multipleOf": 3}}}), "'multipleOf' at /properties/n"),
        (StructuredOutput("regex", "[a-"), "regex does not compile"),
        (StructuredOutput("ebnf", "root ::= missing_rule"), "grammar does not compile"),
        (
            StructuredOutput("lark", "start: missing"),
            "Lark grammar does not compile: Lark error at line 1, column 8: unknown name 'missing'",
        ),
        (StructuredOutput("lark", 'start: ("a" | '), "line 1, column 15: expected ')'"),
        (StructuredOutput("lark", "start: /[a-/"), "Regex parsing error at position 4"),
        (StructuredOutput("lark", '_sep{x}: x ("," x)*\nstart: _sep{"a"}'), "templates"),
        (StructuredOutput("lark", 'root: "a"'), "no start rule found"),
        (StructuredOutput("choice", "[]"), "non-empty strings"),
    ],
)
def test_bad_specs_are_refused_by_name(stories_tokenizer, spec, message) -> None:
    compiler = GrammarCompiler(stories_tokenizer, 512, (2,))
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        compiler.compiled(spec)


def constrained(spec: StructuredOutput, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured=spec, **kw)


def test_outputs_validate_over_many_schemas_at_temperature_one(stories_tokenizer) -> None:
    engine = make_engine(stories_tokenizer, vocab_size=512, max_model_len=256, eos_token_ids=(2,))
    requests = []
    for name, schema in SCHEMAS.items():
        for seed in range(3):
            prompt = [1, 5 + seed, 40]
            requests.append((f"{name}-{seed}", prompt, constrained(json_schema(schema), seed)))
    results = run(engine, requests)
    for request_id, (tokens, reason) in results.items():
        schema = SCHEMAS[request_id.rsplit("-", 1)[0]]
        assert reason == "stop", (request_id, stories_tokenizer.decode(tokens))
        jsonschema.validate(json.loads(stories_tokenizer.decode(tokens)), schema)


def test_unconstrained_rows_get_exactly_their_tokens_alone(stories_tokenizer) -> None:
    def engine():
        return make_engine(stories_tokenizer, vocab_size=512, eos_token_ids=(2,), max_model_len=256)

    plain = [
        ("greedy", [1, 9, 30, 31], SamplingParams(max_tokens=20, temperature=0)),
        ("seeded", [1, 12], SamplingParams(max_tokens=20, temperature=1.0, seed=3)),
        ("logprobs", [1, 7, 7], SamplingParams(max_tokens=12, temperature=0, logprobs=True)),
    ]
    alone = run(engine(), plain)
    mixed = plain + [
        ("json", [1, 9, 30], constrained(StructuredOutput("json"), 1)),
        ("schema", [1, 4], constrained(json_schema(SCHEMAS["nested"]), 2)),
        ("regex", [1, 8], constrained(StructuredOutput("regex", "[0-9]{4}"), 3)),
    ]
    together = run(engine(), mixed)
    for request_id, _, _ in plain:
        assert together[request_id] == alone[request_id]
    assert re.fullmatch("[0-9]{4}", stories_tokenizer.decode(together["regex"][0]))


def test_preemption_and_prefix_cache_keep_constrained_outputs_exact(stories_tokenizer) -> None:
    shared = [1, 20, 21, 22, 23, 24, 25, 26, 27]
    requests = [
        (f"r{i}", shared + [30 + i], constrained(json_schema(SCHEMAS["refs"]), i)) for i in range(6)
    ]
    big = make_engine(stories_tokenizer, vocab_size=512, eos_token_ids=(2,), max_model_len=160)
    alone = {rid: run(big, [(rid, p, s)])[rid] for rid, p, s in requests}
    tiny = make_engine(
        stories_tokenizer,
        vocab_size=512,
        eos_token_ids=(2,),
        num_blocks=40,
        max_model_len=160,
        enable_prefix_caching=True,
    )
    assert run(tiny, requests) == alone
    assert tiny.scheduler.num_preemptions > 0
    for tokens, _ in alone.values():
        jsonschema.validate(json.loads(stories_tokenizer.decode(tokens)), SCHEMAS["refs"])


def test_choice_ebnf_and_logit_bias(stories_tokenizer) -> None:
    engine = make_engine(stories_tokenizer, vocab_size=512, eos_token_ids=(2,), max_model_len=256)
    lark_grammar = 'start: "[" NUM ("-" NUM)~0..2 "]"\nNUM: /[0-9]{1,2}/'
    grammar = 'root ::= "yes" | "no" | "n/a"'
    results = run(
        engine,
        [
            ("choice", [1, 3], constrained(StructuredOutput("choice", '["left", "right"]'), 0)),
            ("ebnf", [1, 3], constrained(StructuredOutput("ebnf", grammar), 0)),
            # A bias of 100 outweighs any logit of the toy model: that token every time.
            ("bias", [1, 3], SamplingParams(max_tokens=5, temperature=0, logit_bias={77: 100})),
        ],
    )
    assert stories_tokenizer.decode(results["choice"][0]) in ("left", "right")
    assert stories_tokenizer.decode(results["ebnf"][0]) in ("yes", "no", "n/a")
    lark_results = run(
        engine,
        [
            (f"lark{seed}", [1, 3], constrained(StructuredOutput("lark", lark_grammar), seed))
            for seed in range(4)
        ],
    )
    for tokens, _ in lark_results.values():
        assert re.fullmatch(r"\[[0-9]{1,2}(-[0-9]{1,2}){0,2}\]", stories_tokenizer.decode(tokens))
    assert results["bias"][0] == [77] * 5


def test_stop_strings_end_a_constrained_request(stories_tokenizer) -> None:
    engine = make_engine(stories_tokenizer, vocab_size=512, eos_token_ids=(2,), max_model_len=256)
    spec = StructuredOutput("regex", "ab(c|d)+x[0-9]{3}")
    params = constrained(spec, 0, stop=["x"])
    tokens, reason = run(engine, [("r", [1, 3], params)])["r"]
    assert reason == "stop"
    assert re.fullmatch("ab(c|d)+", engine.tokenizer.decode(tokens).split("x")[0])


def test_constrained_rows_do_not_speculate_and_their_batch_mates_stay_exact(
    stories_tokenizer,
) -> None:
    """With n-gram speculation on, a grammar's rows take one token a step (their mask
    follows each token) while the plain rows beside them verify proposals and keep exactly
    their greedy tokens."""

    def engine(speculation):
        return make_engine(
            stories_tokenizer,
            vocab_size=512,
            eos_token_ids=(2,),
            max_model_len=256,
            speculation=speculation,
        )

    loop = [1, 9, 30, 31, 9, 30, 31, 9, 30, 31, 9, 30]  # repeats: prompt lookup proposes
    plain = [
        (f"greedy-{i}", loop[i:] + loop[:i], SamplingParams(max_tokens=24, temperature=0))
        for i in range(3)
    ]
    alone = run(engine(SpeculativeConfig()), plain)
    speculating = engine(SpeculativeConfig(method="ngram", num_tokens=4, ngram_max=3))
    mixed = plain + [
        (f"schema-{seed}", loop, constrained(json_schema(SCHEMAS["nested"]), seed))
        for seed in range(3)
    ]
    together = run(speculating, mixed)
    for request_id, _, _ in plain:
        assert together[request_id] == alone[request_id]
    for seed in range(3):
        tokens, reason = together[f"schema-{seed}"]
        assert reason == "stop"
        jsonschema.validate(json.loads(stories_tokenizer.decode(tokens)), SCHEMAS["nested"])
    assert speculating.speculator.stats.proposed > 0
