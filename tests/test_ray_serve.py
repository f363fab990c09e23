"""tandem on Ray Serve (`tandem serve --replicas 2`) on a local Ray instance: two replicas of a tiny
random HF-directory model behind Ray's proxy, through the official `openai` client. Requests spread
over both replicas, a session sticks to its replica, /metrics shows both, greedy output equals one
in-process `tandem serve`, and a replica killed mid-request is replaced while the requests it held
fail with an error the client sees. The pure parts (the replica plan, session ranks, metric
merging) are tested without Ray running."""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import httpx
import openai
import pytest
import ray
from ray import serve

from conftest import build_tiny
from tandem.bench.server_process import free_port
from tandem.launch_server import add_serve_args, build_server_app, configs_from_args, serve_in_background, uses_ray
from tandem.server.metrics import ServerMetrics
from tandem.server.ray_serve import (
    METRICS_TTL_S,
    REPLICA_HEADER,
    ReplicaPlan,
    deploy,
    merge_replica_metrics,
    replica_plan,
    session_rank,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "tiny"
PROMPTS = ["t5 t17 t33 t8 t91 t4", "t60 t61 t62 t60 t61 t62", "t40 t41 t42 t43 t44", "t9 t8 t7 t6 t9 t8"]
REPLACED_WITHIN_S = 120


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


# ---- without Ray running ---------------------------------------------------------------------


def test_replica_plan_from_flags():
    assert replica_plan(2, None, None, None, cores=2) == ReplicaPlan(replicas=2, threads=1)
    assert replica_plan(None, None, None, None, cores=8) == ReplicaPlan(replicas=1, threads=8)
    assert replica_plan(3, None, None, 2, cores=2).threads == 2  # --threads wins, even oversubscribed
    scaling = replica_plan(None, 1, 4, None, cores=8)
    assert (scaling.replicas, scaling.threads, scaling.most_replicas) == (1, 2, 4)
    options = scaling.deployment_options(*configs_from_args(serve_args("--max-running-requests", "8")))
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                             "target_ongoing_requests": 4}
    assert options["ray_actor_options"] == {"num_cpus": 2} and options["max_ongoing_requests"] == 8
    for bad in [(0, None, None), (None, 2, None), (None, 3, 2), (5, 1, 4)]:
        with pytest.raises(ValueError):
            replica_plan(*bad, None, cores=2)


def test_serve_flags_choose_ray_only_when_asked():
    assert not uses_ray(serve_args())
    assert uses_ray(serve_args("--replicas", "2"))
    assert uses_ray(serve_args("--min-replicas", "1", "--max-replicas", "3"))
    assert uses_ray(serve_args("--ray-address", "auto"))


def test_session_rank_moves_only_the_sessions_of_a_leaving_replica():
    sessions = [f"conversation-{i}" for i in range(200)]

    def owners(replicas):
        return {s: max(replicas, key=lambda r: session_rank(s, r)) for s in sessions}

    three = owners(["a", "b", "c"])
    two = owners(["a", "b"])
    assert all(two[s] == three[s] for s in sessions if three[s] != "c")
    assert 40 < sum(owner == "c" for owner in three.values()) < 100  # about a third each
    assert owners(["a", "b", "c"]) == three  # a pure function of the ids (no per-process hash seed)


def test_merged_metrics_label_every_sample_with_its_replica():
    texts = {}
    for replica, finished in (("r1", 2), ("r2", 3)):
        metrics = ServerMetrics(NAME)
        metrics.request_success.labels(model_name=NAME, finished_reason="stop").inc(finished)
        metrics.time_to_first_token.observe(0.05)
        texts[replica] = metrics.render().decode()
    merged = merge_replica_metrics(texts).decode()
    assert merged.count("# TYPE tandem:request_success_total counter") == 1
    assert 'tandem:request_success_total{finished_reason="stop",model_name="tiny",replica="r1"} 2.0' in merged
    assert 'tandem:request_success_total{finished_reason="stop",model_name="tiny",replica="r2"} 3.0' in merged
    assert 'tandem:time_to_first_token_seconds_count{model_name="tiny",replica="r2"} 1.0' in merged


# ---- on a local Ray (slow: Ray and two replicas start in about 30 s here, a replacement in 20) ----


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer ("t5 t17" -> [5, 17]), saved as an HF directory;
    8k positions so one stream can outlast a replica."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny_model")
    hf, _ = build_tiny("llama", max_position_embeddings=8192)
    hf.save_pretrained(root)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2").save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def ray_server(tiny_model_dir, tmp_path_factory):
    """`tandem serve --replicas 2 --threads 1` (suffix drafter, adaptive policy: the driver profiles
    the cost curve once) on a local Ray with 2 CPUs; yields (base URL, the serve flags)."""
    profile = tmp_path_factory.mktemp("profile") / "cost_profile.json"
    args = serve_args("--model", str(tiny_model_dir), "--served-model-name", NAME, "--replicas", "2",
                      "--threads", "1", "--port", str(free_port()), "--max-model-len", "8192",
                      "--max-running-requests", "4", "--speculative-algorithm", "suffix",
                      "--cost-profile", str(profile))
    engine_config, server_config = configs_from_args(args)
    plan = replica_plan(args.replicas, None, None, args.threads, cores=2)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        deployment = deploy(build_server_app, engine_config, server_config, plan)
        assert profile.is_file()  # measured by the driver, before any replica started
        yield deployment.url, args
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


def complete(url: str, prompt: str, session: str | None = None, max_tokens: int = 16) -> tuple[str, str | None]:
    """(text, the replica that answered: None from a server without replicas) of one greedy completion."""
    headers = {"X-Session-Id": session} if session else {}
    raw = client(url).completions.with_raw_response.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0, extra_headers=headers)
    return raw.parse().choices[0].text, raw.headers.get(REPLICA_HEADER)


@pytest.mark.slow
def test_requests_spread_over_both_replicas(ray_server):
    url, _ = ray_server
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: complete(url, PROMPTS[i % len(PROMPTS)]), range(16)))
    assert len({replica for _, replica in answers}) == 2
    for i, (text, _) in enumerate(answers):  # greedy: the replica does not change the answer
        assert text == answers[i % len(PROMPTS)][0]


@pytest.mark.slow
def test_a_session_sticks_to_its_replica(ray_server):
    url, _ = ray_server
    owner = {}
    for turn in range(3):
        for s in range(12):
            _, replica = complete(url, PROMPTS[s % len(PROMPTS)], session=f"conversation-{s}", max_tokens=4)
            assert owner.setdefault(s, replica) == replica, f"session {s} moved on turn {turn}"
    assert len(set(owner.values())) == 2  # sessions are spread, each kept where it started


@pytest.mark.slow
def test_metrics_cover_both_replicas(ray_server):
    url, _ = ray_server
    base = url.removesuffix("/v1")
    replicas = {complete(url, PROMPTS[0], session=f"metrics-{i}", max_tokens=2)[1] for i in range(12)}
    assert len(replicas) == 2
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        if all(f'replica="{r}"' in text for r in replicas):
            break
        assert time.monotonic() < deadline, f"/metrics lacks a replica of {replicas}:\n{text[:2000]}"
        time.sleep(0.5)
    assert text.count("# TYPE tandem:request_success_total counter") == 1
    for r in replicas:
        assert f'tandem:request_success_total{{finished_reason="length",model_name="{NAME}",replica="{r}"}}' in text


@pytest.mark.slow
def test_greedy_output_equals_one_process_server(ray_server):
    url, args = ray_server
    through_ray = [complete(url, p, max_tokens=24)[0] for p in PROMPTS]
    single = serve_in_background(build_server_app(*configs_from_args(args)))
    try:
        assert [complete(single.url, p, max_tokens=24)[0] for p in PROMPTS] == through_ray
    finally:
        single.stop()


def kill_replica(unique_id: str) -> None:
    """ray.kill the Serve replica actor whose id ends its actor name."""
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{unique_id}")]
    assert len(named) == 1, named
    ray.kill(ray.get_actor(named[0]["name"], namespace=named[0]["namespace"]), no_restart=True)


@pytest.mark.slow
def test_a_killed_replica_is_replaced_and_its_requests_fail_cleanly(ray_server):
    url, _ = ray_server
    session = {"X-Session-Id": "doomed"}
    long = dict(model=NAME, prompt=PROMPTS[0], max_tokens=8000, temperature=0, extra_body={"ignore_eos": True},
                extra_headers=session)
    raw = client(url).completions.with_raw_response.create(stream=True, **long)
    victim = raw.headers[REPLICA_HEADER]
    stream = iter(raw.parse())
    next(stream)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        unary = pool.submit(client(url).completions.create, **long)  # same session: the same replica
        time.sleep(1.0)
        kill_replica(victim)
        started = time.monotonic()
        with pytest.raises(openai.APIConnectionError):  # the stream is cut, not left hanging
            for _ in stream:
                pass
        with pytest.raises(openai.InternalServerError):  # the unary request gets a 500
            unary.result(timeout=60)
        assert time.monotonic() - started < 30
    survivors = set()
    deadline = time.monotonic() + REPLACED_WITHIN_S
    while len(survivors) < 2:  # Ray starts a replacement: two live replicas again, the victim not among them
        assert time.monotonic() < deadline, f"no replacement for {victim} within {REPLACED_WITHIN_S} s"
        try:
            survivors.add(complete(url, PROMPTS[1], max_tokens=2)[1])
        except openai.APIError:
            time.sleep(0.5)
    assert victim not in survivors
    homes = {complete(url, PROMPTS[1], session="doomed", max_tokens=2)[1] for _ in range(3)}
    assert len(homes) == 1 and homes <= survivors  # the session found a new home and stays there
    deadline = time.monotonic() + METRICS_TTL_S + 10
    while f'replica="{victim}"' in httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=30).text:
        assert time.monotonic() < deadline, f"the dead replica {victim} is still on /metrics"
        time.sleep(0.5)
