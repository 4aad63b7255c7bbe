# EXPLAIN (ANALYZE, WAL) of the PostgreSQL journal's group-commit statement
# (APPEND_SQL in engine/src/persistence/pg.rs) against the same statement at
# another commit (default 90276e5: the fence that locked each id's writer row
# FOR SHARE; 8f9101f: the one that upserted every writer row),
# and a plain multi-row insert of the same events (what the bench's raw
# baseline does), per statement of ROWS events to ROWS distinct ids out of
# 1,000 whose epoch a recovery claimed (the common case).
#
# Usage (from the repository root, as root or a PostgreSQL superuser):
#   python3 bench-harness/scripts/pg-append-explain.py HOST PORT [N] [ROWS] [OLD_REV]
# N statements per variant (default 200), alternating the variants; each
# variant runs in a database of its own (created and dropped here:
# shardline_explain_new / _old / _raw). Prints per variant the execution
# time (EXPLAIN's "Execution Time", which leaves out the commit) p50 / p90
# and the WAL bytes per statement (pg_current_wal_insert_lsn() before and
# after, so with the commit record) p50 / p90.
import json, random, re, subprocess, sys

HOST, PORT = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200
ROWS = int(sys.argv[4]) if len(sys.argv) > 4 else 64
OLD_REV = sys.argv[5] if len(sys.argv) > 5 else "90276e5"
IDS = 1000
PSQL = "/usr/lib/postgresql/15/bin/psql"


def stmt_of(src):
    m = re.search(r'pub\(crate\) const APPEND_SQL: &str = "(.*?)";', src, re.S)
    if not m:
        sys.exit("APPEND_SQL not found")
    return m.group(1).replace('\\"', '"')


new_sql = stmt_of(open("engine/src/persistence/pg.rs").read())
old_sql = stmt_of(subprocess.run(["git", "show", f"{OLD_REV}:engine/src/persistence/pg.rs"],
                                 capture_output=True, text=True, check=True).stdout)
schema = re.search(r'pub const SCHEMA_SQL: &str = "(.*?)";', open("engine/src/persistence/pg.rs").read(), re.S).group(1)
raw_sql = """INSERT INTO shardline_events (persistence_id, sequence_nr, writer_epoch, payload)
SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::bytea[])"""


def psql(db, script):
    out = subprocess.run([PSQL, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", HOST, "-p", PORT,
                          "-U", "postgres", "-d", db], input=script, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"psql {db}: {out.stderr}")
    return out.stdout


variants = {"new": new_sql, "old": old_sql, "raw": raw_sql}
for v in variants:
    psql("postgres", f"DROP DATABASE IF EXISTS shardline_explain_{v};\nCREATE DATABASE shardline_explain_{v};")
    psql(f"shardline_explain_{v}", schema + f"""
INSERT INTO shardline_writers SELECT 'counter|' || i, 1 FROM generate_series(0, {IDS - 1}) i;
CHECKPOINT;""")

rng = random.Random(1)
seq = {v: [0] * IDS for v in variants}


def arr(xs, cast):
    return "ARRAY[" + ",".join(xs) + "]::" + cast


def call(v, ids):
    s = seq[v]
    evs = []
    for i in ids:
        s[i] += 1
        evs.append((i, s[i]))
    params = [arr([f"'counter|{i}'" for i in ids], "text[]"), arr(["1"] * len(ids), "int8[]"),
              arr([f"'counter|{i}'" for i, _ in evs], "text[]"), arr([str(q) for _, q in evs], "int8[]"),
              arr(["1"] * len(evs), "int8[]"), arr(["'\\x0100000000000000'::bytea"] * len(evs), "bytea[]"),
              "ARRAY[]::text[]", "ARRAY[]::int8[]", "ARRAY[]::int8[]", "ARRAY[]::bytea[]"]
    if v == "raw":
        params = params[2:6]
    elif v == "new" or "$10" not in variants[v]:
        # This build's statement: events and snapshots only (the fence is
        # the primary key and the claim rows).
        params = params[2:]
    return "EXECUTE a(" + ", ".join(params) + ");"


res = {v: [] for v in variants}
scripts = {v: [] for v in variants}
for _ in range(N):
    ids = rng.sample(range(IDS), ROWS)
    for v in variants:
        # This build's writer sends its arrays sorted by persistence id
        # (bytewise); the old one in a hash map's order.
        scripts[v].append(sorted(ids, key=lambda i: f"counter|{i}") if v != "old" else ids)
for v, sql in variants.items():
    lines = ["PREPARE a AS " + sql + ";"]
    for ids in scripts[v]:
        lines.append("SELECT pg_current_wal_insert_lsn() AS l0 \\gset")
        lines.append("EXPLAIN (ANALYZE, TIMING OFF, WAL, FORMAT JSON) " + call(v, ids))
        lines.append("SELECT 'WAL ' || pg_wal_lsn_diff(pg_current_wal_insert_lsn(), :'l0');")
    out = psql(f"shardline_explain_{v}", "\n".join(lines))
    buf = ""
    for line in out.splitlines():
        if line.startswith("WAL "):
            plan = json.loads(buf)[0]
            buf = ""
            res[v].append((plan["Execution Time"], int(float(line[4:]))))
        else:
            buf += line + "\n"
    psql("postgres", f"DROP DATABASE shardline_explain_{v};")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


print(f"{ROWS}-row statements, {N} per variant, ids claimed at epoch 1 (1,000 ids)")
print(f"{'variant':8} {'exec p50':>9} {'exec p90':>9} {'WAL p50':>9} {'WAL p90':>9}")
for v in variants:
    r = res[v]
    t = [x[0] for x in r]
    w = [x[1] for x in r]
    print(f"{v:8} {pct(t, .5):7.3f}ms {pct(t, .9):7.3f}ms {pct(w, .5):9d} {pct(w, .9):9d}")
