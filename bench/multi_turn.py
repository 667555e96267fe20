"""Cache-aware replica choice on a multi-turn chat workload: prefix vs least_loaded at 2 replicas (issue 17 item 4)

    python bench/multi_turn.py [--conversations 12] [--hot 4] [--turns 4] [--concurrency 4] [--json out.json]
    python bench/multi_turn.py --model /path/to/tiny-model --max-model-len 1024 ...   # a quick smoke run

The same model is deployed twice with `llmdeploy apply` (a temporary LLMDEPLOY_HOME, `parallel.replicas: 2`,
OMP_NUM_THREADS=--threads per engine, cloud off), once with `routing.replica_choice: prefix` and once with
`least_loaded`, and the same conversations run through the router each time. Every conversation has its own
system prompt (~--system-words words) and opening user message (~--opening-words); each turn re-sends the whole
history (the previous answers appended) plus a new user message, streams the answer (greedy, --max-tokens tokens,
EOS ignored) and, after a think time, queues the next turn; at most --concurrency requests are in flight.
The --hot conversations share one system prompt and opening (the router's prefix key: the messages up to the
first user message) and start first, as a burst: one hot prefix that the load bound must spread over both
replicas.

Reported per mode: requests, errors, prefix-cache hit rate (sum of usage.prompt_tokens_details.cached_tokens /
sum of prompt_tokens; all turns and follow-up turns only), the client's TTFT p50/p99 (first content chunk;
all turns and follow-ups), how many conversations stayed on one replica, and the per-replica request split
(all, and the hot group's), from the router's access log (the client sends x-request-id; the log names the
replica). Printed with the CPU model, the date and the load average: on a shared machine the load moves the
TTFTs, while hit rates and stickiness are steadier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_vs_hf import MODEL, WORDS  # noqa: E402
from bench.mixed_ttft import cpu_model, load_average, percentile  # noqa: E402
from llmdeploy.spec.addresses import free_port  # noqa: E402

ALIAS = "mt"
MODES = ("prefix", "least_loaded")
LLMDEPLOY = str(Path(sys.executable).with_name("llmdeploy"))
ACCESS_LINE = re.compile(r"llmdeploy\.router\.access: rid=(\S+) .*?\breplica=(\S+)")


# ---- the workload (pure) ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conversation:
    cid: str
    group: str  # "own": its own system prompt and opening; "hot": shares them with the other hot ones
    system: str
    opening: str
    followups: tuple[str, ...]  # the user messages of turns 2..K


def _words(r: random.Random, n: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(n))


def build_conversations(
    own: int, hot: int, turns: int, system_words: int, opening_words: int, followup_words: int, seed: int = 0
) -> list[Conversation]:
    """The hot conversations first (they start as a burst), then the others. Deterministic for a seed."""
    r = random.Random(seed)
    hot_system = f"You are assistant H. Follow the house rules: {_words(r, system_words)}"
    hot_opening = f"Read this brief and wait for questions: {_words(r, opening_words)}"
    convs = []
    for i in range(hot + own):
        group = "hot" if i < hot else "own"
        cid = f"{group}{i if group == 'hot' else i - hot}"
        if group == "hot":
            system, opening = hot_system, hot_opening
        else:  # the conversation's number first: the prefix differs from its first tokens
            system = f"You are assistant {cid}. Follow the house rules: {_words(r, system_words)}"
            opening = f"Conversation {cid}. Read this report: {_words(r, opening_words)}"
        follow = tuple(f"Question {t} from {cid}: {_words(r, followup_words)}?" for t in range(2, turns + 1))
        convs.append(Conversation(cid, group, system, opening, follow))
    return convs


def messages_for(conv: Conversation, turn: int, answers: list[str]) -> list[dict[str, str]]:
    """Turn `turn` (1-based): the system prompt, the opening, then each earlier answer and the next question."""
    if len(answers) < turn - 1:
        raise ValueError(f"turn {turn} needs {turn - 1} earlier answers, got {len(answers)}")
    msgs = [{"role": "system", "content": conv.system}, {"role": "user", "content": conv.opening}]
    for t in range(1, turn):
        msgs.append({"role": "assistant", "content": answers[t - 1]})
        msgs.append({"role": "user", "content": conv.followups[t - 1]})
    return msgs


def request_id(mode: str, cid: str, turn: int) -> str:
    return f"mt-{mode.replace('_', '-')}-{cid}-t{turn}"


# ---- results and their figures (pure) ---------------------------------------------------------------------
@dataclass
class Turn:
    rid: str
    cid: str
    group: str
    turn: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str | None = None


def parse_access_log(text: str) -> dict[str, str]:
    """request id -> the replica that served it, from the router's access lines ("-" when none did)."""
    return {m.group(1): m.group(2) for m in ACCESS_LINE.finditer(text)}


def hit_rate(turns: list[Turn]) -> float | None:
    """Prompt tokens served from the prefix cache / prompt tokens, over the successful turns."""
    prompt = sum(t.prompt_tokens for t in turns if t.ok)
    return sum(t.cached_tokens for t in turns if t.ok) / prompt if prompt else None


def stickiness(turns: list[Turn]) -> tuple[int, int]:
    """(conversations whose every served turn went to one replica, conversations with a known replica)."""
    where: dict[str, set[str]] = {}
    for t in turns:
        if t.ok and t.replica not in (None, "-"):
            where.setdefault(t.cid, set()).add(t.replica)
    return sum(len(s) == 1 for s in where.values()), len(where)


def split(turns: list[Turn]) -> dict[str, int]:
    """Successful requests per replica, by replica name."""
    return dict(sorted(Counter(t.replica or "?" for t in turns if t.ok).items()))


def _pct(xs: list[float], q: float) -> float | None:
    return percentile(xs, q) if xs else None


def summarize(mode: str, turns: list[Turn], wall_s: float) -> dict:
    ok = [t for t in turns if t.ok]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    follow = [t for t in turns if t.turn > 1]
    follow_ttft = [t.ttft_s for t in follow if t.ok and t.ttft_s is not None]
    sticky_own = stickiness([t for t in turns if t.group == "own"])
    sticky_hot = stickiness([t for t in turns if t.group == "hot"])
    return {
        "mode": mode,
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "error_kinds": dict(Counter(t.error for t in turns if not t.ok)),
        "prompt_tokens": sum(t.prompt_tokens for t in ok),
        "cached_tokens": sum(t.cached_tokens for t in ok),
        "hit_rate": hit_rate(turns),
        "hit_rate_followups": hit_rate(follow),
        "hit_rate_first_turns": hit_rate([t for t in turns if t.turn == 1]),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "followup_ttft_p50_s": _pct(follow_ttft, 0.5),
        "followup_ttft_p99_s": _pct(follow_ttft, 0.99),
        "sticky_own": list(sticky_own),
        "sticky_hot": list(sticky_hot),
        "split": split(turns),
        "hot_split": split([t for t in turns if t.group == "hot"]),
        "wall_s": wall_s,
    }


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """a / b for the headline figures (prefix / least_loaded)."""
    keys = ("hit_rate", "hit_rate_followups", "ttft_p50_s", "ttft_p99_s", "followup_ttft_p50_s")
    return {k: (a[k] / b[k] if a.get(k) is not None and b.get(k) else None) for k in keys}


# ---- driving the router -----------------------------------------------------------------------------------
async def one_turn(client: httpx.AsyncClient, body: dict, rid: str) -> tuple[Turn, str]:
    """Send one streamed turn; the Turn (without its conversation fields) and the answer text."""
    t = Turn(rid, "", "", 0)
    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/chat/completions", json=body, headers={"x-request-id": rid}) as r:
            if r.status_code != 200:
                t.error = f"http_{r.status_code}"
                await r.aread()
                return t, ""
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    t.error = "stream_error"
                    return t, ""
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        t.ttft_s = t.ttft_s if t.ttft_s is not None else time.perf_counter() - t0
                        text.append(piece)
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    t.prompt_tokens = usage.get("prompt_tokens") or 0
                    t.completion_tokens = usage.get("completion_tokens") or 0
                    t.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (httpx.HTTPError, OSError, ValueError) as exc:
        t.error = type(exc).__name__
        return t, ""
    t.e2e_s = time.perf_counter() - t0
    t.ok = t.prompt_tokens > 0  # the usage chunk came: the stream finished
    t.error = None if t.ok else "no_usage"
    return t, "".join(text)


async def drive(url: str, mode: str, convs: list[Conversation], args) -> tuple[list[Turn], float]:
    gate = asyncio.Semaphore(args.concurrency)
    results: list[Turn] = []
    think = random.Random(args.seed + 1)

    async def conversation(conv: Conversation, client: httpx.AsyncClient) -> None:
        answers: list[str] = []
        for turn in range(1, args.turns + 1):
            body = {
                "model": ALIAS,
                "messages": messages_for(conv, turn, answers),
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,  # every answer the same length, whichever replica serves it
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                t, answer = await one_turn(client, body, request_id(mode, conv.cid, turn))
            t.cid, t.group, t.turn = conv.cid, conv.group, turn
            results.append(t)
            if not t.ok:
                return  # a conversation without its answer cannot go on
            answers.append(answer or "(no answer)")
            await asyncio.sleep(think.uniform(0, 2 * args.think_s))

    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        tasks = []
        for conv in convs:  # created in order: the hot burst queues at the gate first
            tasks.append(asyncio.create_task(conversation(conv, client)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


# ---- deployments ------------------------------------------------------------------------------------------
def spec_for(mode: str, model: str, port: int, args) -> dict:
    return {
        "name": f"mtbench-{mode.replace('_', '-')}",
        "model": {"path": model, "served_alias": ALIAS, "max_model_len": args.max_model_len},
        "listen": f"127.0.0.1:{port}",
        "engine": {"kv_cache_gb": args.kv_cache_gb, "max_num_seqs": 16, "device": "cpu"},
        "parallel": {"replicas": 2},
        # the bench measures the engines: no burst limit, no queue limit, no predicted-TTFT refusals
        "routing": {
            "replica_choice": mode,
            **({"prefix_load_slack": args.slack} if args.slack is not None else {}),
            "burst": {"local_rps": 100000},
            "overflow": {"use_predicted_ttft": False, "max_queue_depth": 4096},
        },
        "auth": {"api_key_required": False},
        "logging": {"level": "info"},  # the router's access lines name each request's replica
    }


def cli(home: Path, threads: int, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMDEPLOY_HOME": str(home), "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([LLMDEPLOY, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(
            f"llmdeploy {' '.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
        )
    return r


def replicas_of(log: Path, rids: set[str], wait_s: float = 10) -> dict[str, str]:
    """The access lines are written as each answer ends: wait a little for the last ones."""
    deadline = time.monotonic() + wait_s
    while True:
        found = parse_access_log(log.read_text(errors="replace")) if log.exists() else {}
        if rids <= found.keys() or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def run_mode(mode: str, convs: list[Conversation], home: Path, args) -> dict:
    spec = spec_for(mode, args.model, free_port(), args)
    path = home / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    t0 = time.perf_counter()
    try:
        cli(home, args.threads, "apply", str(path))
        start_s = time.perf_counter() - t0
        print(f"{mode}: deployed in {start_s:.0f} s (load {load_average()})", file=sys.stderr, flush=True)
        turns, wall = asyncio.run(drive(f"http://{spec['listen']}/v1", mode, convs, args))
        where = replicas_of(home / spec["name"] / "logs" / "daemon.log", {t.rid for t in turns})
    finally:
        try:
            cli(home, args.threads, "down", "--name", spec["name"], timeout=120)
        except (RuntimeError, subprocess.SubprocessError) as exc:
            print(f"{mode}: down failed: {exc}", file=sys.stderr)
    for t in turns:
        t.replica = where.get(t.rid)
    res = summarize(mode, turns, wall)
    res["startup_s"] = start_s
    res["turns"] = [asdict(t) for t in turns]
    print(
        f"{mode}: {len(turns)} requests in {wall:.0f} s (load {load_average()})", file=sys.stderr, flush=True
    )
    return res


# ---- report -----------------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _split(counts: dict[str, int], names: list[str]) -> str:
    """ "r1 10 / r2 6": every replica of the mode, the ones this group never reached as 0."""
    return " / ".join(f"{n} {counts.get(n, 0)}" for n in names)


def table(runs: list[dict]) -> str:
    head = (
        "| replica_choice | requests | errors | prefix hit | hit (follow-ups) | TTFT p50 (s) | TTFT p99 (s) "
        "| follow-up TTFT p50 / p99 (s) | own convs on 1 replica | hot convs on 1 replica | split | hot split "
        "| wall (s) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for r in runs:
        names = sorted(r["split"])
        so, sh = r["sticky_own"], r["sticky_hot"]
        rows.append(
            f"| {r['mode']} | {r['requests']} | {r['errors']} | {_f(r['hit_rate'], '.1%')} "
            f"| {_f(r['hit_rate_followups'], '.1%')} | {_f(r['ttft_p50_s'], '.3f')} | {_f(r['ttft_p99_s'], '.3f')} "
            f"| {_f(r['followup_ttft_p50_s'], '.3f')} / {_f(r['followup_ttft_p99_s'], '.3f')} "
            f"| {so[0]}/{so[1]} | {sh[0]}/{sh[1]} | {_split(r['split'], names)} "
            f"| {_split(r['hot_split'], names) if r['hot_split'] else '-'} | {r['wall_s']:.1f} |"
        )
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL, help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--conversations", type=int, default=12, help="conversations with their own prefix")
    ap.add_argument("--hot", type=int, default=4, help="conversations sharing one hot prefix (0: none)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--opening-words", type=int, default=60)
    ap.add_argument("--followup-words", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    ap.add_argument("--think-s", type=float, default=0.5, help="mean pause between a conversation's turns")
    ap.add_argument(
        "--slack", type=float, default=None, help="routing.prefix_load_slack (default: the spec's)"
    )
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results (with every request) to this file")
    args = ap.parse_args(argv)
    if args.conversations + args.hot < 1 or args.turns < 1 or args.concurrency < 1:
        ap.error("--conversations + --hot, --turns and --concurrency must be at least 1")
    if not args.model.startswith("builtin:"):
        args.model = str(Path(args.model).resolve())
    convs = build_conversations(
        args.conversations,
        args.hot,
        args.turns,
        args.system_words,
        args.opening_words,
        args.followup_words,
        args.seed,
    )
    load_before = load_average()
    home = Path(tempfile.mkdtemp(prefix="llmdeploy-mt-"))
    try:
        runs = [run_mode(mode, convs, home, args) for mode in args.modes]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "runs": runs,
    }
    by_mode = {r["mode"]: r for r in runs}
    if set(MODES) <= by_mode.keys():
        res["prefix_over_least_loaded"] = ratios(by_mode["prefix"], by_mode["least_loaded"])
    print(
        f"date: {res['date']}   CPU: {res['cpu']} ({res['cpus']} CPUs)   load average before/after: "
        f"{load_before} / {res['load_average_after']}"
    )
    print(
        f"model {args.model}, 2 replicas x {args.threads} thread(s); {args.hot} hot + {args.conversations} own "
        f"conversations x {args.turns} turns, {args.concurrency} in flight, {args.max_tokens} tokens per answer"
    )
    print(table(runs))
    if "prefix_over_least_loaded" in res:
        q = res["prefix_over_least_loaded"]
        print("prefix / least_loaded: " + ", ".join(f"{k} {_f(v, '.2f')}x" for k, v in q.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if all(r["errors"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
