"""The toy family's bench plug-in (``BENCH``: one ``echo`` mode and one flag of its own), for the bench registry's
test: it runs no server and says what it was asked, so the test sees the dispatch and the parsed flags."""

from __future__ import annotations

from omni_serve.bench.plugins import BenchPlugin


def _bench_arguments(group) -> None:
    group.add_argument("--echo-words", type=int, default=3, help="words per toy request (default 3)")


def _bench_run(args) -> int:
    """Runs no server: says what it was asked, so a test sees the dispatch and the parsed flags."""
    print(f"toy bench {args.mode} of {args.graph}: {args.echo_words} words to {args.url}, c={args.concurrency}")
    return 0 if args.url else 2


BENCH = BenchPlugin(family="toy", modes={"echo": "send words, read them back"}, add_arguments=_bench_arguments,
                    run=_bench_run)
