"""Who wrote each token, and the page that shows it: `return_provenance` on the OpenAI routes
(pieces that join to exactly the text, origins that match the rounds, held-back text keeping its
tokens' origins, nothing added when not asked for), the per-request draft cap, and the playground
page at / in a real headless Chromium (Debian's chromium + chromium-driver, through selenium)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import ToyTokenizer, tiny_loaded
from test_server import NAME, PROMPTS, chat_loaded, client, plain_greedy, start
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engine.rounds import round_origins
from tandem.engine.request import Request
from tandem.llm import LLM
from tandem.server.responses import TokenPiece
from tandem.types import TOKEN_ORIGINS, Draft

pytestmark = pytest.mark.usefixtures("one_thread")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


# ---- origins of one round ------------------------------------------------------------------------


def test_round_origins_of_chains_and_trees():
    chain = Draft([11, 12, 13])
    assert round_origins(Draft.empty(), []) == ["target"]
    assert round_origins(chain, []) == ["recovered"]
    assert round_origins(chain, [0, 1]) == ["accepted", "accepted", "recovered"]
    assert round_origins(chain, [0, 1, 2]) == ["accepted"] * 3 + ["bonus"]
    # root -> 0 -> 1, root -> 2: after node 0 the tree goes on (node 1), after node 2 it does not.
    tree = Draft([11, 12, 13], parents=[-1, 0, -1])
    assert round_origins(tree, [0]) == ["accepted", "recovered"]
    assert round_origins(tree, [2]) == ["accepted", "bonus"]
    assert round_origins(tree, [0, 1]) == ["accepted", "accepted", "bonus"]
    assert round_origins(tree, []) == ["recovered"]


class WordTokenizer(ToyTokenizer):
    """Ids to words, so a stop string can span tokens: 10 -> "ab", 11 -> "c", 12 -> "d ", 2 = EOS."""

    WORDS = {10: "ab", 11: "c", 12: "d "}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.WORDS.get(i, f"<{i}>") for i in ids if not (skip_special_tokens and i == 2))


def request(stop=()) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=stop, token_origins=True)
    return Request("r", [1], params, torch.Generator(), frozenset({2}))


def test_pieces_join_to_the_text_and_held_back_text_keeps_its_origins():
    tok = WordTokenizer()
    req = request(stop=("cd!",))
    req.append([10, 11], tok, ["accepted", "recovered"])
    # "abc" could still grow into the stop string "cd!": "c" is held back.
    start = req.emitted_text_len
    first = req.take_new_text()
    assert first == "ab" and req.origin_pieces(start, start + len(first)) == [("ab", "accepted")]
    req.append([12], tok, ["bonus"])
    start = req.emitted_text_len
    second = req.take_new_text()
    assert second == "cd "
    # The released "c" keeps the origin of the token that wrote it.
    assert req.origin_pieces(start, start + len(second)) == [("c", "recovered"), ("d ", "bonus")]
    assert req.token_origins == ["accepted", "recovered", "bonus"]


def test_pieces_follow_a_stop_string_cut():
    tok = WordTokenizer()
    req = request(stop=("bc",))
    kept = req.append([10, 11, 12], tok, ["accepted", "accepted", "bonus"])
    assert kept == 2 and req.finished and req.text == "a"
    start = req.emitted_text_len
    text = req.take_new_text()
    assert text == "a" and req.origin_pieces(start, start + 1) == [("a", "accepted")]


def test_the_library_reports_origins_per_token():
    _, loaded = tiny_loaded("llama")
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, max_num_seqs=2,
                                               spec=SpecConfig(algorithm="suffix", num_draft_tokens=4)))
    prompt = PROMPTS[2]
    asked, plain = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=30, token_origins=True),
                                                   SamplingParams(temperature=0.0, max_tokens=30)])
    assert asked.token_ids == plain.token_ids and plain.token_origins is None
    assert len(asked.token_origins) == len(asked.token_ids)
    assert asked.token_origins.count("accepted") == asked.spec.num_accepted_tokens > 0
    assert asked.token_origins[0] == "target"  # sampled by the prompt's forward


def test_every_origin_is_named_in_the_protocol():
    for origin in TOKEN_ORIGINS:
        TokenPiece(text="x", origin=origin)


# ---- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suffix_server(one_thread):
    server, engine = start(chat_loaded(), SpecConfig(algorithm="suffix", num_draft_tokens=4))
    yield server, engine
    server.stop()


def post(server, route: str, body: dict) -> dict:
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(server, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + route, json={**body, "stream": True}, timeout=60) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def check_provenance(text: str, provenance: dict, completion_tokens: int) -> None:
    assert "".join(p["text"] for p in provenance["pieces"]) == text
    rounds = provenance["rounds"]
    # Each round commits its accepted drafts and one token of the target's, but the last one
    # keeps none of the target's when it ends on an accepted stop token.
    assert sum(r["accepted"] + 1 for r in rounds) - completion_tokens in (0, 1)
    assert all(0 <= r["accepted"] <= r["depth"] for r in rounds)


def test_provenance_on_completions_matches_the_rounds_and_the_text(suffix_server):
    server, _ = suffix_server
    for prompt in PROMPTS[:3]:
        plain = post(server, "/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0})
        assert "provenance" not in plain["choices"][0]  # not asked for: the OpenAI schema, unchanged
        got = post(server, "/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0,
                                            "return_provenance": True})
        choice = got["choices"][0]
        assert choice["text"] == plain["choices"][0]["text"] == plain_greedy(chat_loaded(), prompt, 30)[0]
        check_provenance(choice["text"], choice["provenance"], got["usage"]["completion_tokens"])
        # ToyTokenizer writes one "<id>" per token: each piece is one token, its origin from its round.
        origins = [p["origin"] for p in choice["provenance"]["pieces"]]
        want = []
        for r in choice["provenance"]["rounds"]:
            last = "target" if r["depth"] == 0 else ("bonus" if r["accepted"] == r["depth"] else "recovered")
            want += ["accepted"] * r["accepted"] + [last]
        assert origins == want
        assert got["spec"]["num_accepted_tokens"] == origins.count("accepted")
    assert "accepted" in origins and "bonus" in origins  # the repetitive prompts are drafted well


def test_streamed_provenance_carries_every_round_and_joins_to_the_content(suffix_server):
    server, _ = suffix_server
    body = {"messages": [{"role": "user", "content": " ".join(map(str, PROMPTS[1]))}], "max_tokens": 24,
            "temperature": 0, "return_provenance": True, "stream_options": {"include_usage": True}}
    chunks = stream_chunks(server, "/chat/completions", body)
    choices = [c for chunk in chunks for c in chunk["choices"]]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    provenance = {"pieces": [p for c in choices if "provenance" in c for p in c["provenance"]["pieces"]],
                  "rounds": [r for c in choices if "provenance" in c for r in c["provenance"]["rounds"]]}
    check_provenance(text, provenance, chunks[-1]["usage"]["completion_tokens"])
    for c in choices:  # each chunk's pieces are exactly its own content
        if "provenance" in c:
            assert "".join(p["text"] for p in c["provenance"]["pieces"]) == (c["delta"].get("content") or "")
    non_stream = post(server, "/chat/completions", {**body, "stream_options": None})
    assert non_stream["choices"][0]["message"]["content"] == text
    # Through the official client the extension is an extra field, the rest OpenAI's own types.
    r = client(server).chat.completions.create(model=NAME, messages=body["messages"], max_tokens=24, temperature=0,
                                               extra_body={"return_provenance": True})
    assert r.choices[0].message.content == text
    assert "".join(p["text"] for p in r.choices[0].model_extra["provenance"]["pieces"]) == text


def test_a_request_can_turn_its_drafts_down_or_off(suffix_server):
    server, _ = suffix_server
    prompt = PROMPTS[2]
    want = post(server, "/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0})["choices"][0]["text"]
    off = post(server, "/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0,
                                        "speculative_num_draft_tokens": 0, "return_provenance": True})
    assert off["choices"][0]["text"] == want
    assert off["spec"]["num_draft_tokens"] == 0
    assert {p["origin"] for p in off["choices"][0]["provenance"]["pieces"]} == {"target"}
    one = post(server, "/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0,
                                        "speculative_num_draft_tokens": 1, "return_provenance": True})
    assert one["choices"][0]["text"] == want
    assert max(r["depth"] for r in one["choices"][0]["provenance"]["rounds"]) == 1
    bad = httpx.post(server.url + "/completions", json={"prompt": prompt, "speculative_num_draft_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative_num_draft_tokens"


def test_models_name_the_drafter(suffix_server):
    server, _ = suffix_server
    card = httpx.get(server.url + "/models").json()["data"][0]
    assert card["speculative_algorithm"] == "suffix" and card["speculative_num_draft_tokens"] == 4


# ---- the page in a real browser -------------------------------------------------------------------------


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def run_page(base: str, prompt: str, timeout_s: float, screenshot: Path | None = None) -> dict:
    """Open the page, send `prompt` and wait for the answer; what the page shows."""
    driver = browser()
    try:
        driver.get(base + "/")
        wait = WebDriverWait(driver, timeout_s)
        wait.until(lambda d: "drafter" in d.find_element(By.ID, "server").text)
        box = driver.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys(prompt)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "done")
        shown = {
            "server": driver.find_element(By.ID, "server").text,
            "answer": driver.find_element(By.ID, "answer").text,
            "error": driver.find_element(By.ID, "error").text,
            "origins": [s.get_attribute("class") for s in driver.find_elements(By.CSS_SELECTOR, "#answer span")],
            "tau": driver.find_element(By.ID, "tau").text,
            "tokens": driver.find_element(By.ID, "tokens").text,
            "acceptance": driver.find_element(By.ID, "acceptance").text,
            "bars": len(driver.find_elements(By.CSS_SELECTOR, "#chart rect")),
        }
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(screenshot))
        return shown
    finally:
        driver.quit()


def test_the_page_streams_an_answer_coloured_by_who_wrote_it(suffix_server):
    server, _ = suffix_server
    base = server.url.removesuffix("/v1")
    prompt = " ".join(map(str, PROMPTS[1]))
    shown = run_page(base, prompt, timeout_s=60)  # max tokens: 64, half the tiny context
    assert shown["error"] == ""
    assert "suffix" in shown["server"]
    answer = client(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=64, temperature=0)
    assert shown["answer"] == answer.choices[0].message.content
    assert int(shown["tokens"]) == answer.usage.completion_tokens  # the server's count, once the answer ends
    assert "accepted" in shown["origins"]
    assert float(shown["tau"]) > 1.0 and shown["acceptance"].endswith("%")
    assert shown["bars"] >= 1


def test_the_page_says_so_when_the_server_goes_away_mid_answer(one_thread):
    """A stream cut before its end (here the drain timeout of a shutdown ran out) is an error the
    page names, not a finished answer; the buttons come back."""
    from tandem.engine.engine import Engine
    from tandem.launch_server import serve_in_background
    from tandem.server.app import build_app
    from tandem.server.async_engine import AsyncEngine
    from tandem.server.metrics import ServerMetrics

    engine = Engine(chat_loaded(), EngineConfig(max_model_len=8192, max_num_seqs=2))
    server = serve_in_background(build_app(AsyncEngine(engine, 4, ServerMetrics(NAME)), NAME), drain_timeout_s=0.5)
    driver = browser()
    try:
        driver.get(server.url.removesuffix("/v1") + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "drafter" in d.find_element(By.ID, "server").text)
        driver.execute_script("document.getElementById('max_tokens').value = 8000;")
        box = driver.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys(" ".join(map(str, PROMPTS[1])))
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "answer").text)
        server.stop()
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "done")
        error = driver.find_element(By.ID, "error").text
        assert "cut off" in error or "went away" in error, error
        assert driver.find_element(By.ID, "send").is_enabled()
    finally:
        driver.quit()
        server.stop()


@pytest.mark.slow
def test_the_page_on_the_default_model_and_drafter(tmp_path):
    """The real default model and its drafter at a fixed draft length (the adaptive policy may
    rightly draft nothing on a slow CPU). With TANDEM_PLAYGROUND_SCREENSHOT=results/serve/playground.png
    it writes the screenshot the README shows; a plain run leaves the repository alone."""
    from tandem.launch_server import add_serve_args, build_server_app, configs_from_args, serve_in_background

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine_config, server_config = configs_from_args(parser.parse_args(
        ["--max-model-len", "1024", "--speculative-policy", "fixed", "--speculative-num-draft-tokens", "4"]))
    server = serve_in_background(build_server_app(engine_config, server_config))
    try:
        prompt = ("Repeat this list twice, exactly: apples, pears, plums, cherries, grapes, figs, "
                  "lemons, limes, oranges, peaches.")
        shot = Path(os.environ.get("TANDEM_PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
        shown = run_page(server.url.removesuffix("/v1"), prompt, timeout_s=300, screenshot=shot)
    finally:
        server.stop()
    assert shown["error"] == ""
    assert shown["answer"]
    assert {"accepted", "target"} & set(shown["origins"]) and "accepted" in shown["origins"]
    assert shot.stat().st_size > 10_000
