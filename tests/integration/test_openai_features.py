"""The OpenAI features real clients use, through the official `openai` client against a
real cluster, disaggregated (1 prefill + 1 decode, KV over NIXL) and mixed (one mixed
worker): log-probabilities equal to a float32 HF transformers log-softmax within 1e-3
(echo + logprobs, chat logprobs + top_logprobs, streamed and not), several choices per
request (n, best_of), the sampling parameters, structured output (every json_schema
answer parses and validates), forced tool calls that always parse, and a load-testing
client's habits (GET /health first, ignore_eos for fixed output lengths). Tests that
cancel end with the leak probe."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from engine.tokenizer import ChatMessage, Tokenizer
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from tests.conftest import MODEL_CACHE
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): log-probabilities within 1e-3 of HF float32, and
# greedy forks equal; the disaggregated cluster is there to carry prompt log-probabilities
# and forks across the hop, which its short prompts would otherwise skip.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.FLOAT32, Pin.PREFILL_HOP)]

PROMPT = "The three primary colors are red, yellow and"
QUESTION = "Name a fruit that is yellow."
TOLERANCE = 1e-3
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module", params=["disaggregated", "mixed"])
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    mixed = request.param == "mixed"
    c = LocalCluster(
        ClusterConfig(
            gateway_port=0,
            num_prefill=0 if mixed else 1,
            num_decode=1,
            model_cache_dir=MODEL_CACHE,
            worker_kv_cache_bytes=96 << 20,
        )
    )
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    assert cluster.http_address
    return openai.OpenAI(
        base_url=f"http://{cluster.http_address}/v1", api_key="none", max_retries=0, timeout=180
    )


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return m.eval()


def _hf_logprobs(
    hf: torch.nn.Module, prompt: list[int], steps: int
) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation of `prompt` for `steps` tokens, and the float32
    log-softmax over every position of prompt + continuation ([len, vocab])."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        logits = hf(torch.tensor([ids])).logits[0].float()
    return ids[len(prompt) :], torch.log_softmax(logits, dim=-1)


# -- a load-testing client's habits ----------------------------------------------------
def test_health_then_fixed_length_with_ignore_eos(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=10) as reply:
        assert reply.status == 200
    # A one-word answer ends early on EOS; ignore_eos makes every answer max_tokens long.
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Reply with one word: hi"}],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 40
    assert chat.choices[0].finish_reason == "length"


# -- log-probabilities -------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_logprobs_equal_hf(
    client: openai.OpenAI, model: str, tokenizer: Tokenizer, hf: torch.nn.Module, stream: bool
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    steps = 4
    expected_ids, ref = _hf_logprobs(hf, prompt_ids, steps)
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": steps, "temperature": 0,
              "logprobs": 3, "echo": True}  # fmt: skip
    if stream:
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        text = ""
        for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                values += choice.logprobs.token_logprobs or []
                tops += choice.logprobs.top_logprobs or []
    else:
        reply = client.completions.create(**kwargs)  # type: ignore[call-overload]
        lp = reply.choices[0].logprobs
        assert lp is not None
        text = reply.choices[0].text
        tokens, values, tops = lp.tokens or [], lp.token_logprobs or [], lp.top_logprobs or []
    all_ids = prompt_ids + expected_ids
    assert text.startswith(PROMPT)
    assert tokens == [tokenizer.token_bytes(t).decode("utf-8", "replace") for t in all_ids]
    assert values[0] is None and tops[0] is None
    for position in range(1, len(all_ids)):
        want = float(ref[position - 1, all_ids[position]])
        got = values[position]
        assert got is not None and abs(got - want) < TOLERANCE, (position, got, want)
        top = tops[position]
        assert top is not None and len(top) >= 3
    # The greedy tokens are the most likely ones: each is its position's top entry.
    for position in range(len(prompt_ids), len(all_ids)):
        top = tops[position]
        assert top is not None and max(top, key=lambda k: top[k]) == tokens[position]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs_equal_hf(
    client: openai.OpenAI, model: str, tokenizer: Tokenizer, hf: torch.nn.Module, stream: bool
) -> None:
    prompt_ids = tokenizer.encode_chat([ChatMessage("user", QUESTION)])
    steps = 6
    expected_ids, ref = _hf_logprobs(hf, prompt_ids, steps)
    kwargs = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
              "max_tokens": steps, "temperature": 0, "logprobs": True, "top_logprobs": 2,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content or []
    else:
        reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        assert reply.choices[0].logprobs is not None
        content = reply.choices[0].logprobs.content or []
    assert len(content) == steps
    for i, entry in enumerate(content):
        token = expected_ids[i]
        want = float(ref[len(prompt_ids) + i - 1, token])
        assert abs(entry.logprob - want) < TOLERANCE
        assert bytes(entry.bytes or []) == tokenizer.token_bytes(token)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely
        second = ref[len(prompt_ids) + i - 1].topk(2)
        assert abs(entry.top_logprobs[1].logprob - float(second.values[1])) < TOLERANCE


# -- several choices -----------------------------------------------------------------------
def test_n_choices_and_best_of(client: openai.OpenAI, model: str, tokenizer: Tokenizer) -> None:
    # Usage as OpenAI counts it: the prompt once, the completion tokens of every fork run
    # (best_of's discarded ones too). ignore_eos makes each fork exactly max_tokens long.
    prompt_tokens = len(tokenizer.encode(PROMPT))
    fixed = {"ignore_eos": True}
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=4,
        extra_body=fixed,
    )  # fmt: skip
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert len({c.text for c in reply.choices}) > 1  # each fork samples its own stream
    assert {c.finish_reason for c in reply.choices} == {"length"}
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 4 * 8)
    assert reply.usage.total_tokens == prompt_tokens + 4 * 8
    again = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=4,
        extra_body=fixed,
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]
    greedy = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
        temperature=0, n=2, extra_body=fixed,
    )  # fmt: skip
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    chat_prompt_tokens = len(tokenizer.encode_chat([ChatMessage("user", QUESTION)]))
    usage = greedy.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (chat_prompt_tokens, 2 * 8)
    best = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, n=1, best_of=3,
        extra_body=fixed,
    )  # fmt: skip
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage is not None
    assert (best.usage.prompt_tokens, best.usage.completion_tokens) == (prompt_tokens, 3 * 6)
    assert best.usage.total_tokens == prompt_tokens + 3 * 6


def test_streamed_n_choices_each_end(client: openai.OpenAI, model: str) -> None:
    texts: dict[int, str] = {}
    ended: dict[int, str] = {}
    for chunk in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0.9, seed=5, n=3, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                ended[c.index] = c.finish_reason
    assert sorted(ended) == [0, 1, 2] and all(texts.values())


# -- sampling parameters -------------------------------------------------------------------
def test_sampling_parameters(client: openai.OpenAI, model: str, tokenizer: Tokenizer) -> None:
    forced = tokenizer.encode(" banana")[0]
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert reply.choices[0].text == tokenizer.decode([forced] * 3)
    stop = client.completions.create(
        model=model, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0, stop=[" 5"],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert stop.choices[0].text.endswith(" 5") and stop.choices[0].finish_reason == "stop"
    eos = tokenizer.eos_token_id
    assert eos is not None
    early = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0,
        logit_bias={str(eos): 100}, extra_body={"min_tokens": 4},
    )  # fmt: skip
    # Four tokens first, then the forced EOS: the fifth.
    assert early.usage is not None and early.usage.completion_tokens == 5
    assert early.choices[0].finish_reason == "stop"
    mixed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0.7, seed=2,
        presence_penalty=1.5, frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "top_k": 20,
                    "stop_token_ids": [eos], "skip_special_tokens": False},
    )  # fmt: skip
    assert mixed.choices[0].finish_reason in ("stop", "length")


# -- structured output ---------------------------------------------------------------------
def _person(client: openai.OpenAI, model: str, seed: int) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Invent a person (number {seed}) as JSON."}],
        max_tokens=80,
        temperature=0.8,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    return reply.choices[0].message.content or ""


def test_json_schema_answers_always_validate(
    client: openai.OpenAI, model: str, cluster: LocalCluster
) -> None:
    count = 50 if cluster.cfg.num_prefill else 12
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda s: _person(client, model, s), range(count)))
    for text in answers:
        jsonschema.validate(json.loads(text), PERSON)


def test_guided_choice_regex_and_json_object(client: openai.OpenAI, model: str) -> None:
    choice = client.completions.create(
        model=model, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(
        model=model, prompt="A date:", max_tokens=12, temperature=0.5, seed=1,
        extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
    )  # fmt: skip
    assert len(regex.choices[0].text) == 10 and regex.choices[0].text.startswith("20")
    obj = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a JSON object."}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    content = obj.choices[0].message.content or ""
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "q"}], response_format=bad
        )  # type: ignore[call-overload]
    assert "response_format" in str(info.value)


# -- tool calling ----------------------------------------------------------------------------
def _ask_weather(
    client: openai.OpenAI, model: str, seed: int, choice: object
) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"What is the weather in city number {seed}?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0.7,
        seed=seed,
    )


def test_required_and_named_tool_calls_always_parse(client: openai.OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    with ThreadPoolExecutor(4) as pool:
        required = list(pool.map(lambda s: _ask_weather(client, model, s, "required"), range(8)))
        forced = list(pool.map(lambda s: _ask_weather(client, model, s, named), range(4)))
    for reply in required + forced:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        call = calls[0]
        assert call.function.name in ("get_weather", "get_time")
        arguments = json.loads(call.function.arguments)
        schema = WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL
        jsonschema.validate(arguments, schema["function"]["parameters"])  # type: ignore[index]
    assert all(r.choices[0].message.tool_calls[0].function.name == "get_weather" for r in forced)  # type: ignore[index]


def test_tool_results_go_back_and_streamed_calls(client: openai.OpenAI, model: str) -> None:
    first = _ask_weather(client, model, 1, "required")
    call = (first.choices[0].message.tool_calls or [])[0]
    follow = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "c": 21}'},
        ],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        max_tokens=30,
        temperature=0,
    )
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls
    deltas = []
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            deltas += chunk.choices[0].delta.tool_calls
        if chunk.choices and chunk.choices[0].finish_reason:
            assert chunk.choices[0].finish_reason == "tool_calls"
    assert deltas and deltas[0].function is not None and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert "city" in json.loads(arguments)


def test_cancelled_n_stream_frees_everything(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    probe = start_probe(cluster)
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=200, temperature=1.0, n=4, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 6:
            break
    stream.close()
    assert_cluster_clean(probe)
