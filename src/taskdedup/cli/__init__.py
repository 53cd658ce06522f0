"""``taskdedup``: see and free locks, and check a deployment (``taskdedup --help``).

Every command reads the store the app or broker uses (``-A proj.celery_app`` or
``--broker-module proj.tasks:broker``), or a store given by ``--url`` and ``--prefix``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import click

from ..stores.base import ForceUnlock, Inspect, ListScopes, ListSlots, LockInfo, Scan
from .doctor import EXIT, run_checks
from .explain import due_in, explain, find_key
from .target import Target, resolve


class Group(click.Group):
    """The group's options are taken after the subcommand too (``taskdedup locks --url ...``,
    the order ``celery -A proj worker`` users also type), unless the subcommand has an
    option of that name itself (``migrate --url``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._hoisted(ctx, args))

    def _hoisted(self, ctx: click.Context, args: list[str]) -> list[str]:
        ours = {name for param in self.params for name in param.opts}
        at = 0
        while at < len(args) and args[at] not in self.commands:  # (past our own options)
            at += 1 if args[at].startswith("-") and "=" in args[at] else 2
        if at >= len(args):
            return args
        command = self.commands[args[at]]
        theirs = {name for param in command.get_params(ctx) for name in param.opts}
        front, rest, index = args[: at + 1], args[at + 1 :], 0
        moved: list[str] = []
        while index < len(rest) and rest[index] != "--":
            name = rest[index].split("=", 1)[0]
            if name in ours and name not in theirs:
                width = 1 if "=" in rest[index] else 2
                moved += rest[index : index + width]
                del rest[index : index + width]
            else:
                index += 1
        return front[:-1] + moved + front[-1:] + rest


@click.group(cls=Group)
@click.option("-A", "--app", help="The Celery app, as `celery -A` takes it.")
@click.option("--broker-module", help="The taskiq broker, as module:variable.")
@click.option(
    "--url",
    help="The store's URL, redis://, postgresql:// or sqlite:/// (instead of an app or broker).",
)
@click.option("--prefix", default="taskdedup", show_default=True, help="With --url: key prefix.")
@click.pass_context
def cli(
    ctx: click.Context, app: str | None, broker_module: str | None, url: str | None, prefix: str
) -> None:
    """See and free taskdedup's locks, and check a deployment."""
    ctx.obj = lambda: resolve(app, broker_module, url, prefix)  # (resolved by each command)


def target(ctx: click.Context) -> Target:
    found: Target = ctx.obj()
    ctx.call_on_close(found.store.close)  # (a SQL store's pool: closed, not left to the GC)
    return found


@cli.command()
@click.option("--task", "task_name", help="Only this task's locks.")
@click.option("--state", type=click.Choice(["queued", "running", "throttled"]))
@click.option("--limit", default=1000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per lock.")
@click.pass_context
def locks(
    ctx: click.Context, task_name: str | None, state: str | None, limit: int, as_json: bool
) -> None:
    """The live locks: which job holds each key, since when, and where it runs."""
    t = target(ctx)
    found = [
        info
        for info in t.store.run(Scan(limit))
        if (task_name is None or info.task == task_name) and (state is None or info.state == state)
    ]
    if as_json:
        for info in found:
            click.echo(json.dumps(_record(t, info)))
        return
    rows = [_row(t, info) for info in found]
    named = ("KEY", "TASK", "STRATEGY", "STATE", "HOLDER", "WORKER", "TRIES", "AGE", "TTL")
    _table((*named, "DUPS", "DUE"), rows)  # DUE: when a debounced holder's run is due
    click.echo(f"{len(found)} lock(s)")


@cli.command()
@click.argument("key")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx: click.Context, key: str, as_json: bool) -> None:
    """One lock, every field (exit 1 when nothing holds KEY)."""
    t = target(ctx)
    info = _held(t, key)
    record = _record(t, info)
    if as_json:
        click.echo(json.dumps(record))
        return
    for name, value in record.items():
        click.echo(f"{name:>12}: {'-' if value is None else value}")


@cli.command(name="explain")
@click.argument("what", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def explain_command(ctx: click.Context, what: tuple[str, ...], as_json: bool) -> None:
    """What was decided for a key and why, most recent first. WHAT is a key, a job id, or a
    task and its arguments (``ci.build sha=abc`` or ``ci.build abc``)."""
    t = target(ctx)
    explain(t, find_key(t, what), as_json, job=what[0] if len(what) == 1 else None)


@cli.command()
@click.argument("key")
@click.option("--yes", is_flag=True, help="Do not ask.")
@click.option("--dry-run", is_flag=True, help="Show what would be freed; free nothing.")
@click.pass_context
def unlock(ctx: click.Context, key: str, yes: bool, dry_run: bool) -> None:
    """Free KEY whoever holds it (a stuck lock). The job that held it is not stopped: if it
    still runs, a duplicate may now run beside it."""
    t = target(ctx)
    info = _held(t, key)
    what = _describe(t, info)
    if dry_run:
        click.echo(f"would free {what}")
        return
    if not yes:
        click.confirm(f"free {what}?", abort=True)
    freed = t.store.run(ForceUnlock(key))
    click.echo(f"freed {what}" if freed else f"{key} was freed meanwhile")


@cli.command()
@click.argument("scope", required=False)
@click.pass_context
def reservations(ctx: click.Context, scope: str | None) -> None:
    """The reservation scopes in use, or the slots of SCOPE (who holds each, for how long)."""
    t = target(ctx)
    if scope is None:
        scopes = t.store.run(ListScopes())
        _table(("SCOPE", "IN FLIGHT"), [(s, str(len(t.store.run(ListSlots(s))))) for s in scopes])
        return
    slots = t.store.run(ListSlots(scope))
    _table(("MEMBER", "EXPIRES IN"), [(s.member, _seconds(s.expires_in_ms)) for s in slots])


@cli.command()
@click.pass_context
def stats(ctx: click.Context) -> None:
    """Live locks by task and state, and slots in flight by scope (what the store holds now;
    decision counters are the metrics' and each process's ``Deduplicator.stats``)."""
    t = target(ctx)
    counts: dict[tuple[str, str], int] = {}
    for info in t.store.run(Scan(100_000)):
        ident = (info.task or "?", info.state)
        counts[ident] = counts.get(ident, 0) + 1
    _table(("TASK", "STATE", "LOCKS"), [(a, b, str(n)) for (a, b), n in sorted(counts.items())])
    scopes = t.store.run(ListScopes())
    slots = sum(len(t.store.run(ListSlots(s))) for s in scopes)
    click.echo(f"reservations: {slots} slot(s) in flight in {len(scopes)} scope(s)")


@cli.command()
@click.option("--url", "own_url", help="The SQL store's URL (else the group's target).")
@click.option("--prefix", "own_prefix", help="With --url: the key prefix (default taskdedup).")
@click.option("--sql", "print_sql", is_flag=True, help="Print PostgreSQL's statements; run none.")
@click.option("--schema", default="public", show_default=True, help="With --sql: the schema.")
@click.pass_context
def migrate(
    ctx: click.Context, own_url: str | None, own_prefix: str | None, print_sql: bool, schema: str
) -> None:
    """Create or upgrade a SQL store's tables (PostgreSQL, SQLite); safe to run again, and
    from several hosts at once. ``--sql`` prints the PostgreSQL statements instead, for a
    migration of your own (Django RunSQL, Alembic op.execute)."""
    if print_sql:
        from ..stores.postgres_schema import migration

        for statement in migration(own_prefix or "taskdedup", schema):
            click.echo(statement.rstrip() + ";\n")
        return
    store = _sql_store(ctx, own_url, own_prefix)
    version = store.migrate()
    click.echo(f"{store.table}: schema version {version}")


@cli.command()
@click.option("--url", "own_url", help="The SQL store's URL (else the group's target).")
@click.option("--prefix", "own_prefix", help="With --url: the key prefix (default taskdedup).")
@click.pass_context
def purge(ctx: click.Context, own_url: str | None, own_prefix: str | None) -> None:
    """Remove a SQL store's expired rows now (normal traffic also removes them, a batch at a
    time; expired rows are ignored either way)."""
    store = _sql_store(ctx, own_url, own_prefix)
    click.echo(f"{store.table}: {store.purge()} expired row(s) removed")


def _sql_store(ctx: click.Context, url: str | None, prefix: str | None) -> Any:
    from ..stores import from_url

    if url is not None:
        store = from_url(url, key_prefix=prefix or "taskdedup")
        ctx.call_on_close(store.close)
    else:
        store = target(ctx).store
    if not hasattr(store, "migrate"):
        raise click.UsageError(
            f"{type(store).__name__} has no tables: migrate and purge are for the SQL stores "
            "(postgresql://, sqlite:///)"
        )
    return store


@cli.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """Check what bites deployments; exit 0 (fine), 1 (warnings) or 2 (errors)."""
    findings = run_checks(target(ctx))
    for f in findings:
        click.echo(f"{f.level:<8}{f.check:<11}{f.message}")
    sys.exit(max((EXIT[f.level] for f in findings), default=0))


def _held(t: Target, key: str) -> LockInfo:
    """What holds ``key``; exit 1, saying so, when nothing does."""
    info = t.store.run(Inspect(key))
    if info is None:
        click.echo(f"nothing holds {key}", err=True)
        sys.exit(1)
    return info


def _record(t: Target, info: LockInfo) -> dict[str, Any]:
    record = dataclasses.asdict(info)
    policy = t.policies.get(info.task or "")
    record["strategy"] = policy.policy.strategy if policy is not None else None
    record["age_s"] = None if info.since_ms is None else round(_age(info.since_ms), 3)
    record["due_in_s"] = None if info.due_ms is None else round(due_in(info.due_ms), 3)
    return record


def _row(t: Target, info: LockInfo) -> tuple[str, ...]:
    policy = t.policies.get(info.task or "")
    return (
        info.key,
        info.task or "?",
        policy.policy.strategy if policy is not None else "-",
        info.state,
        info.job_id,
        info.worker or "-",
        str(info.attempts),
        "-" if info.since_ms is None else _seconds(_age(info.since_ms) * 1000),
        _seconds(info.ttl_ms),
        str(info.duplicates),
        "-" if info.due_ms is None else _seconds(due_in(info.due_ms) * 1000),
    )


def _describe(t: Target, info: LockInfo) -> str:
    where = f" on {info.worker}" if info.worker else ""
    return f"{info.key} ({info.task or 'task unknown'}, {info.state}, held by {info.job_id}{where})"


def _age(since_ms: int) -> float:
    return max(0.0, time.time() - since_ms / 1000)


def _seconds(ms: float) -> str:
    s = ms / 1000
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def _table(heads: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(heads)]
    for line in (heads, *rows):
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())


def main() -> None:
    cli(prog_name="taskdedup")
