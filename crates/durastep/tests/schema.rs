//! The migrated schema against the code and the migrations: the run states
//! that `runs_state_check` allows are `RunState::ALL`, the entry kinds are
//! `EntryKind`'s, and every function and
//! view in the `durastep` schema is the text of the last migration that
//! defines it, so a later migration that redefines one is noticed here.

use std::collections::{BTreeMap, BTreeSet};

mod common;

use durastep::{Ctx, Event, Function, RunState};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

/// The migrations, oldest first: (file name, text).
fn migrations() -> Vec<(String, String)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../migrations");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("read migrations/")
        .map(|e| e.expect("migration entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).expect("read migration"))
        })
        .collect()
}

/// Every case-insensitive occurrence of `head` in `sql` (which ends in
/// `durastep.`), with the name after it: (offset of `head`, offset of the
/// name, the name).
fn named(sql: &str, head: &str) -> Vec<(usize, usize, String)> {
    let lower = sql.to_lowercase();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = lower[from..].find(head) {
        let at = from + i;
        let start = at + head.len();
        let len = sql[start..].find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(0);
        out.push((at, start, sql[start..start + len].to_owned()));
        from = start;
    }
    out
}

/// Every `CREATE [OR REPLACE] <kind> durastep.<name>` in `sql`, with the
/// offset just after the name.
fn definitions(sql: &str, kind: &str) -> Vec<(String, usize)> {
    [format!("create {kind} durastep."), format!("create or replace {kind} durastep.")]
        .iter()
        .flat_map(|head| named(sql, head))
        .map(|(_, start, name)| {
            let end = start + name.len();
            (name, end)
        })
        .collect()
}

/// Every `ALTER FUNCTION durastep.<old>(...) RENAME TO <new>` in `sql`: (old,
/// new, offset of the statement).
fn renames(sql: &str) -> Vec<(String, String, usize)> {
    let lower = sql.to_lowercase();
    named(sql, "alter function durastep.")
        .into_iter()
        .filter_map(|(at, start, old)| {
            let end = start + lower[start..].find(';').expect("the end of ALTER FUNCTION");
            let to = lower[start..end].find("rename to ")?;
            Some((old, sql[start + to + "rename to ".len()..end].trim().to_owned(), at))
        })
        .collect()
}

/// Every `DROP FUNCTION durastep.<name>` in `sql`: (name, offset of the statement).
fn drops(sql: &str) -> Vec<(String, usize)> {
    named(sql, "drop function durastep.").into_iter().map(|(at, _, name)| (name, at)).collect()
}

/// A function's body: the text between its dollar-quote markers (`$$` or `$tag$`).
fn dollar_body(sql: &str, from: usize) -> String {
    let open = from + sql[from..].find('$').expect("a dollar-quoted body");
    let close = open + 1 + sql[open + 1..].find('$').expect("the end of the dollar tag");
    let tag = &sql[open..=close];
    let end = close + 1 + sql[close + 1..].find(tag).expect("the closing dollar tag");
    sql[close + 1..end].to_owned()
}

/// A view's query: from after `AS` to the `;` that ends the statement
/// (outside quotes, comments and parentheses).
fn view_query(sql: &str, from: usize) -> String {
    let rest = &sql[from..];
    let as_at = rest.to_lowercase().find(" as").expect("AS after the view name") + 3;
    let bytes = rest.as_bytes();
    let (mut i, mut depth, mut quoted) = (as_at, 0i32, false);
    while i < bytes.len() {
        match bytes[i] {
            b'\'' => quoted = !quoted,
            b'-' if !quoted && bytes.get(i + 1) == Some(&b'-') => {
                i += rest[i..].find('\n').unwrap_or(rest.len() - i);
                continue;
            }
            b'(' if !quoted => depth += 1,
            b')' if !quoted => depth -= 1,
            b';' if !quoted && depth == 0 => break,
            _ => {}
        }
        i += 1;
    }
    rest[as_at..i].to_owned()
}

/// Catches: a state added to (or dropped from) the database's list without
/// `RunState` knowing it, which would make a stored run unreadable (decoding
/// an unknown state is an error), or a `runs_state_check` that no longer
/// checks against that list (since migration 0040 the enum type
/// `durastep.run_state`; before, a list in the constraint).
#[sqlx::test(migrations = false)]
async fn run_states_are_the_state_check_constraint_s_list(pool: PgPool) {
    durastep::migrate(&pool).await.expect("migrate");
    let def: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint
          WHERE conname = 'runs_state_check' AND conrelid = 'durastep.runs'::regclass",
    )
    .fetch_one(&pool)
    .await
    .expect("runs_state_check");
    assert!(def.contains("::durastep.run_state"), "runs_state_check is {def}");
    let in_db: BTreeSet<String> = sqlx::query_scalar("SELECT unnest(enum_range(NULL::durastep.run_state))::text")
        .fetch_all(&pool)
        .await
        .expect("the enum's labels")
        .into_iter()
        .collect();
    let in_code: BTreeSet<String> = RunState::ALL.iter().map(|s| s.as_str().to_owned()).collect();
    assert_eq!(in_db, in_code, "durastep.run_state against RunState::ALL");
}

/// Catches: a journal entry kind the database allows and `EntryKind` does
/// not read (a stored entry would make its run's replay fail), or a check
/// of the step rows' or the journal's kinds that no longer names the enum
/// type `durastep.entry_kind` (migration 0040).
#[sqlx::test(migrations = false)]
async fn entry_kinds_are_the_kind_checks_list(pool: PgPool) {
    durastep::migrate(&pool).await.expect("migrate");
    let defs: Vec<(String, String)> = sqlx::query_as(
        "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
          WHERE conname IN ('step_results_entry', 'step_journal_kind_check') ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .expect("the kind checks");
    assert_eq!(defs.len(), 2, "{defs:?}");
    for (name, def) in &defs {
        assert!(def.contains("::durastep.entry_kind"), "{name} is {def}");
    }
    let in_db: Vec<String> = sqlx::query_scalar("SELECT unnest(enum_range(NULL::durastep.entry_kind))::text")
        .fetch_all(&pool)
        .await
        .expect("the enum's labels");
    assert_eq!(in_db.len(), 7, "{in_db:?}");
    for label in &in_db {
        let kind: durastep::EntryKind = label.parse().unwrap_or_else(|_| panic!("EntryKind does not read {label}"));
        assert_eq!(kind.as_str(), label);
    }
}

/// Catches: a condition of `runs_changed` (migration 0041) narrower than
/// the five row triggers it replaced, or one its hot rows satisfy. A row one
/// of the five fired for on which the one trigger does not call its function
/// would lose a history row, an on-failure run, a parent's outcome, a cancel
/// notice, a flow release or an attempt's claim record; a claim or a
/// completion of a plain run that satisfies it would call PL/pgSQL once per
/// row on the hot path. The five conditions as their migrations wrote them,
/// and the trigger's as the database holds it, are evaluated over every
/// combination of the values they read: the old and new state, the lease
/// epoch and the history mark changed or not, slots held before or not, a
/// parent or not, and the claim record unchanged (NULL or not) or changed.
/// Checked by changing the migration: without its last clause (running, the
/// same `claim_id`) 27 rows are left uncovered, without `cancelled` 12, and
/// with `OR NEW.state = 'running'` added 2 hot rows call the function.
#[sqlx::test(migrations = false)]
async fn the_one_row_trigger_s_condition_covers_the_five_it_replaced(pool: PgPool) {
    durastep::migrate(&pool).await.expect("migrate");
    let def: String = sqlx::query_scalar(
        "SELECT pg_get_triggerdef(oid) FROM pg_trigger
          WHERE tgrelid = 'durastep.runs'::regclass AND tgname = 'runs_changed'",
    )
    .fetch_one(&pool)
    .await
    .expect("the trigger runs_changed");
    let when = def
        .split_once(" WHEN ")
        .and_then(|(_, rest)| rest.split_once(" EXECUTE FUNCTION "))
        .map(|(when, _)| when.replace("new.", "n.").replace("old.", "o."))
        .unwrap_or_else(|| panic!("a WHEN in {def}"));
    let sql = format!(
        "WITH s(v) AS (VALUES ('queued'), ('running'), ('sleeping'), ('waiting'), ('completed'), ('failed'),
                              ('cancelled'), ('skipped'), ('diverged')),
              b(v) AS (VALUES (false), (true)),
              k(v) AS (VALUES (0), (1), (2)),
              rows AS (
                  SELECT o, n FROM s os, s ns, b epoch, b noted, b held, b parent, b claimed, k claim,
                   LATERAL (SELECT os.v AS state, 1::bigint AS lease_epoch, false AS history_noted,
                                   CASE WHEN held.v THEN '[[\"r\", \"k\"]]'::jsonb END AS flow_held,
                                   CASE WHEN parent.v THEN gen_random_uuid() END AS parent_run_id,
                                   CASE WHEN claimed.v THEN '00000000-0000-0000-0000-000000000001'::uuid END
                                       AS claim_id) o,
                   LATERAL (SELECT ns.v AS state, o.lease_epoch + epoch.v::int AS lease_epoch,
                                   noted.v AS history_noted, o.parent_run_id,
                                   CASE claim.v WHEN 0 THEN o.claim_id WHEN 1 THEN gen_random_uuid() END
                                       AS claim_id) n),
              judged AS (
                  SELECT (n.state = 'failed' AND o.state <> 'failed')
                         OR (n.parent_run_id IS NOT NULL AND n.state IN ('completed', 'failed', 'cancelled')
                             AND o.state NOT IN ('completed', 'failed', 'cancelled'))
                         OR ((n.state <> o.state OR n.lease_epoch <> o.lease_epoch)
                             AND n.history_noted = o.history_noted)
                         OR (o.flow_held IS NOT NULL OR (o.state = 'running' AND n.state = 'cancelled'))
                         OR (n.state = 'running' AND n.lease_epoch IS DISTINCT FROM o.lease_epoch
                             AND n.claim_id IS NOT DISTINCT FROM o.claim_id) AS five,
                         coalesce({when}, false) AS one,
                         -- A claim of a plain run (queued to running, a new
                         -- epoch and claim record, its own history row) or
                         -- its completion.
                         n.history_noted AND o.flow_held IS NULL AND o.parent_run_id IS NULL
                         AND ((o.state = 'queued' AND n.state = 'running' AND n.lease_epoch <> o.lease_epoch
                               AND n.claim_id IS NOT NULL AND n.claim_id IS DISTINCT FROM o.claim_id)
                              OR (o.state = 'running' AND n.state = 'completed'
                                  AND n.lease_epoch = o.lease_epoch)) AS hot
                    FROM rows r, LATERAL (SELECT (r.o).*) o, LATERAL (SELECT (r.n).*) n)
         SELECT count(*) FILTER (WHERE five), count(*) FILTER (WHERE five AND NOT one),
                count(*) FILTER (WHERE hot AND one)
           FROM judged"
    );
    let (fired, uncovered, hot): (i64, i64, i64) =
        sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_one(&pool).await.expect("evaluate the conditions");
    assert!(fired > 1_000, "the combinations reach the five conditions: {fired}");
    assert_eq!(uncovered, 0, "rows one of the five fired for, which runs_changed skips ({when})");
    assert_eq!(hot, 0, "claims or completions of a plain run call run_changed ({when})");
}

/// Catches: a trigger on `durastep.runs` that fires on UPDATE and keeps
/// transition tables. Postgres then copies the old and the new version of
/// every row of every UPDATE of `runs` (each claim, each completion) into
/// them, whether the trigger needs the row or not: about 10% of the CPU per
/// run in the drain (migration 0026 moved the flow release's rows to a row
/// trigger with a `WHEN`).
#[sqlx::test(migrations = false)]
async fn no_update_trigger_on_runs_keeps_transition_tables(pool: PgPool) {
    durastep::migrate(&pool).await.expect("migrate");
    // tgtype bit 4 (16) is UPDATE.
    let capturing: Vec<String> = sqlx::query_scalar(
        "SELECT tgname::text FROM pg_trigger
          WHERE tgrelid = 'durastep.runs'::regclass AND (tgtype & 16) <> 0
            AND (tgoldtable IS NOT NULL OR tgnewtable IS NOT NULL)",
    )
    .fetch_all(&pool)
    .await
    .expect("triggers of durastep.runs");
    assert_eq!(capturing, Vec::<String>::new(), "UPDATE triggers on durastep.runs with transition tables");
}

/// Catches: a full index added to `durastep.runs`. Claims and completions
/// are not HOT updates, so each writes an entry into every index whose
/// predicate its new row meets: a full index costs every run two more
/// (migration 0031 dropped `runs_created` for about 6% of a drain's CPU per
/// run; listings walk the primary key; migration 0042 moved `UNIQUE
/// (event_id, function_id)` into `run_keys`, written once per run, for 14%
/// of a claim's server instructions). A new one needs a reason here.
#[sqlx::test(migrations = false)]
async fn runs_has_no_full_index_beyond_its_keys(pool: PgPool) {
    durastep::migrate(&pool).await.expect("migrate");
    let full: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
          WHERE i.indrelid = 'durastep.runs'::regclass AND i.indpred IS NULL ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .expect("indexes of durastep.runs");
    // The primary key alone.
    assert_eq!(full, ["runs_pkey"], "full indexes of durastep.runs");
    // The listings' stand-in for runs with random ids holds none of the
    // runs an engine creates.
    let predicate: String = sqlx::query_scalar(
        "SELECT pg_get_expr(i.indpred, i.indrelid) FROM pg_index i
          WHERE i.indexrelid = 'durastep.runs_created_legacy'::regclass",
    )
    .fetch_one(&pool)
    .await
    .expect("runs_created_legacy");
    let minted: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT bool_or({predicate}) FROM (SELECT durastep.uuid7() AS id FROM generate_series(1, 1000)) r"
    )))
    .fetch_one(&pool)
    .await
    .expect("the predicate on minted ids");
    assert!(!minted, "a time-ordered id enters runs_created_legacy: {predicate}");
}

/// The indexes of `durastep.runs` that name a column a plain run's claim or
/// completion changes: the due queue's two, which a claim leaves by nature,
/// and the six of run features whose predicates name `state` (migration
/// 0038 put them back there: the generated columns 0032 had moved them onto
/// cost every writer more than the HOT updates they prepared, which never
/// came; docs/performance.md "Counted instructions"). (`runs_running`, which
/// every claim entered and every completion left, is gone since migration
/// 0034, and `runs_diverged` since 0043.)
const CHANGED_BY_CLAIMS: [&str; 8] = [
    "runs_due",
    "runs_next_due",
    "runs_singleton",
    "runs_debounce",
    "runs_deadline",
    "runs_start_by",
    "runs_listed_by_state",
    "runs_attempt_stopping",
];

/// Catches: an index of `durastep.runs` beyond the eight above that names a
/// column a claim or a completion of a plain run changes (`state`,
/// `started_at`, `worker_id`, `finished_at`, ...), in its key or its
/// predicate. Postgres keeps an update HOT (no index entry written) only
/// when no indexed column changes, so such an index would be one more to
/// move before claims and completions could be HOT (migration 0033 dropped
/// `runs_finished`, which every completion entered, and 0034
/// `runs_running`). The test drops the eight, drains runs with the real
/// worker, and reads the table's HOT count: with any other blocking index it
/// is zero.
#[sqlx::test(migrations = false)]
async fn claims_and_completions_leave_every_other_index_alone(_p: PgPoolOptions, opts: PgConnectOptions) {
    const RUNS: i64 = 200;
    let f = Function::new("plain")
        .on_event("plain/go")
        .handler(|ctx: Ctx, n: u32| async move { ctx.step("one", || async move { Ok(n + 1) }).await });
    let engine = common::engine(&opts, vec![f]).await;
    let admin = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.expect("connect");
    // Room on each page for the new row versions, as a HOT update needs.
    sqlx::query("ALTER TABLE durastep.runs SET (fillfactor = 50)").execute(&admin).await.expect("fillfactor");
    let events = (0..RUNS).map(|n| Event::new("plain/go", &n)).collect();
    let receipts = engine.send_batch(events).await.expect("send");
    // Dropped after the send, whose full fan-out names the singleton and
    // debounce indexes as its arbiters.
    for index in CHANGED_BY_CLAIMS {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP INDEX durastep.{index}")))
            .execute(&admin)
            .await
            .expect("drop index");
    }
    let w = common::spawn_worker(&engine);
    for r in &receipts {
        common::finished(&engine, r.run_ids[0]).await;
    }
    w.stop().await;
    // The workers' sessions report their counts when they end.
    engine.pool().close().await;
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    let (updates, hot) = loop {
        let (updates, hot): (i64, i64) = sqlx::query_as(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'durastep.runs'::regclass",
        )
        .fetch_one(&admin)
        .await
        .expect("table statistics");
        if updates >= 2 * RUNS {
            break (updates, hot);
        }
        assert!(tokio::time::Instant::now() < deadline, "{updates} updates of durastep.runs reported");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    // Most of them could be HOT, each as long as its page has room; none
    // while one more index names a column they change.
    assert!(hot * 4 >= updates, "{hot} of {updates} updates of durastep.runs were HOT");
}

/// Catches: a migration that redefines a function or view in a way the
/// repository does not show in one place (a later `CREATE OR REPLACE` that
/// this parse misses, a function created by hand), or a function whose text
/// the database holds differently from its last migration.
#[sqlx::test(migrations = false)]
async fn every_function_and_view_is_its_last_migration_s_text(pool: PgPool) {
    durastep::migrate(&pool).await.expect("migrate");
    assert_eq!(drift(&pool).await, Vec::<String>::new());
}

/// The check is not vacuous: a function and a view changed after the
/// migrations are both reported.
#[sqlx::test(migrations = false)]
async fn a_function_or_view_changed_outside_the_migrations_is_reported(pool: PgPool) {
    durastep::migrate(&pool).await.expect("migrate");
    sqlx::query(
        "CREATE OR REPLACE FUNCTION durastep.now() RETURNS timestamptz LANGUAGE sql STABLE AS $$ SELECT now() $$",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("CREATE VIEW durastep.stray AS SELECT 1 AS one").execute(&pool).await.unwrap();
    let found = drift(&pool).await;
    assert!(found.iter().any(|d| d.contains("durastep.now")), "{found:?}");
    assert!(found.iter().any(|d| d.contains("stray")), "{found:?}");
}

/// Where the migrated database's functions and views differ from the last
/// migration that defines each (empty: none).
async fn drift(pool: &PgPool) -> Vec<String> {
    let mut functions: BTreeMap<String, (String, String)> = BTreeMap::new();
    let mut views: BTreeMap<String, (String, String)> = BTreeMap::new();
    for (file, sql) in migrations() {
        // Definitions, renames and drops in the order the migration runs them.
        enum Step {
            Define,
            Rename(String),
            Drop,
        }
        let mut steps: Vec<(usize, String, Step)> =
            definitions(&sql, "function").into_iter().map(|(name, at)| (at, name, Step::Define)).collect();
        steps.extend(renames(&sql).into_iter().map(|(old, new, at)| (at, new, Step::Rename(old))));
        steps.extend(drops(&sql).into_iter().map(|(name, at)| (at, name, Step::Drop)));
        steps.sort_by_key(|(at, ..)| *at);
        for (at, name, step) in steps {
            match step {
                Step::Define => {
                    functions.insert(name, (file.clone(), dollar_body(&sql, at)));
                }
                Step::Rename(old) => {
                    let defined = functions.remove(&old).expect("a rename of a defined function");
                    functions.insert(name, defined);
                }
                Step::Drop => {
                    functions.remove(&name).expect("a drop of a defined function");
                }
            }
        }
        for (name, at) in definitions(&sql, "view") {
            views.insert(name, (file.clone(), view_query(&sql, at)));
        }
    }
    let mut out = Vec::new();

    let stored: Vec<(String, String)> = sqlx::query_as(
        "SELECT p.proname::text, p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          WHERE n.nspname = 'durastep' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let names: BTreeSet<&str> = stored.iter().map(|(n, _)| n.as_str()).collect();
    let defined: BTreeSet<&str> = functions.keys().map(String::as_str).collect();
    if names != defined {
        out.push(format!("functions: in the database {names:?}, in the migrations {defined:?}"));
    }
    if names.len() != stored.len() {
        out.push("a function name is overloaded".into());
    }
    for (name, src) in &stored {
        match functions.get(name) {
            Some((file, body)) if src != body => {
                out.push(format!("durastep.{name}: the database's text differs from its last definition, in {file}"))
            }
            _ => {}
        }
    }

    // A view's text is what Postgres deparses: the last definition, created
    // again in a scratch schema, must deparse to the same text.
    let stored: Vec<String> =
        sqlx::query_scalar("SELECT viewname::text FROM pg_views WHERE schemaname = 'durastep' ORDER BY 1")
            .fetch_all(pool)
            .await
            .unwrap();
    let names: BTreeSet<&str> = stored.iter().map(String::as_str).collect();
    let defined: BTreeSet<&str> = views.keys().map(String::as_str).collect();
    if names != defined {
        out.push(format!("views: in the database {names:?}, in the migrations {defined:?}"));
    }
    sqlx::query("CREATE SCHEMA durastep_check").execute(pool).await.unwrap();
    for (name, (file, query)) in &views {
        if !names.contains(name.as_str()) {
            continue;
        }
        // The text of a migration in this repository, in a test database.
        let create = format!("CREATE VIEW durastep_check.{name} AS {query}");
        sqlx::query(sqlx::AssertSqlSafe(create)).execute(pool).await.unwrap();
        let (db, migration): (String, String) =
            sqlx::query_as("SELECT pg_get_viewdef($1::regclass), pg_get_viewdef($2::regclass)")
                .bind(format!("durastep.{name}"))
                .bind(format!("durastep_check.{name}"))
                .fetch_one(pool)
                .await
                .unwrap();
        if db != migration {
            out.push(format!("durastep.{name}: the database's view differs from its last definition, in {file}"));
        }
    }
    out
}

/// The parse itself, on a small migration.
#[test]
fn definitions_are_found_with_their_bodies() {
    let sql = "CREATE OR REPLACE FUNCTION durastep.f(a int) RETURNS int LANGUAGE sql AS $body$ SELECT 1; $body$;\n\
               CREATE VIEW durastep.v AS SELECT (1) AS x -- a comment; with a semicolon\n FROM t WHERE y = ';';";
    let f = definitions(sql, "function");
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].0, "f");
    assert_eq!(dollar_body(sql, f[0].1), " SELECT 1; ");
    let v = definitions(sql, "view");
    assert_eq!(v[0].0, "v");
    let r = renames("ALTER FUNCTION durastep.f(int)\n    RENAME TO g;\nALTER FUNCTION durastep.h(int) OWNER TO x;");
    assert_eq!(r, vec![("f".to_owned(), "g".to_owned(), 0)]);
    assert_eq!(drops("SELECT 1;\nDROP FUNCTION durastep.old_one();"), vec![("old_one".to_owned(), 10)]);
    assert_eq!(view_query(sql, v[0].1), " SELECT (1) AS x -- a comment; with a semicolon\n FROM t WHERE y = ';'");
}

/// Migrates `pool` as the engine does (the same schema and bookkeeping
/// table), up to and including migration `version`: the state an upgrade
/// starts from.
async fn migrate_to(pool: &PgPool, version: i64) {
    let mut before = sqlx::migrate!("../../migrations");
    before.create_schema("durastep");
    before.dangerous_set_table_name("durastep._migrations");
    before.run_to(version, pool).await.unwrap_or_else(|e| panic!("migrate to {version}: {e}"));
}

/// Catches: migration 0035 leaving the renamed handing sends
/// (`send_event_to_worker`, `send_event_to_worker_by_claim`) without the
/// grants of the pair they replace, or open to PUBLIC where the old pair was
/// not: a deployment whose runtime role was granted the old pair (the
/// recipe of docs/security.md before 0035) would fail every handing send
/// after the upgrade, or a locked-down one would be opened. The database is
/// migrated to 0034, locked down and granted as that recipe did, then
/// migrated on.
#[sqlx::test(migrations = false)]
async fn the_renamed_handing_sends_take_the_old_pair_s_grants(pool: PgPool) {
    migrate_to(&pool, 34).await;
    let role = format!("durastep_grants_{}", uuid::Uuid::new_v4().simple());
    let sig = "(uuid, text, text, text, integer, uuid, double precision, text[], integer[], integer)";
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role};
         REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA durastep FROM PUBLIC;
         GRANT EXECUTE ON FUNCTION durastep.send_event_handing{sig}, durastep.send_event_handing_by_claim{sig}
            TO {role}"
    )))
    .execute(&pool)
    .await
    .expect("the grants of 0034's recipe");
    durastep::migrate(&pool).await.expect("migrate on");
    let granted: Vec<(String, bool, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT p.proname::text, has_function_privilege('{role}', p.oid, 'EXECUTE'),
                has_function_privilege('public', p.oid, 'EXECUTE')
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          WHERE n.nspname = 'durastep' AND p.proname LIKE 'send_event_to_worker%' ORDER BY 1"
    )))
    .fetch_all(&pool)
    .await
    .expect("the new pair's grants");
    // The role goes before the verdict: it is the cluster's, not the test database's.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP OWNED BY {role}; DROP ROLE {role}")))
        .execute(&pool)
        .await
        .expect("drop the role");
    let expected = [("send_event_to_worker", true, false), ("send_event_to_worker_by_claim", true, false)];
    let expected: Vec<(String, bool, bool)> = expected.iter().map(|(f, r, p)| ((*f).to_owned(), *r, *p)).collect();
    assert_eq!(granted, expected, "(function, the role may execute it, PUBLIC may)");
}

/// Catches: migration 0042 leaving `run_keys` without the privileges roles
/// have on `runs`: the trigger that keys new runs runs with the inserting
/// role's rights, so a deployment's runtime role (granted on `runs` by the
/// recipe of docs/security.md before 0042) would fail every send after the
/// upgrade, and its reader role every event's run count. The database is
/// migrated to 0041, two roles are granted on `runs` as that recipe did,
/// then it is migrated on.
#[sqlx::test(migrations = false)]
async fn the_run_keys_take_the_grants_of_runs(pool: PgPool) {
    let granted = privileges_after_migrating(
        &pool,
        41,
        &["app", "reader"],
        |[app, reader]| {
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON durastep.runs TO {app};
                 GRANT SELECT ON durastep.runs TO {reader}"
            )
        },
        "durastep.run_keys",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
    )
    .await;
    assert_eq!(
        granted,
        [true, true, true, true, true, false, false, false, false, false, false, false],
        "(app, reader, PUBLIC: S I U D)"
    );
}

/// Each of `privileges` on `table`, for each role of `roles` (created with a
/// fresh suffix) and then PUBLIC, after the database was migrated to
/// `version`, granted by `grants` (given the roles' full names) as that
/// version's recipe in docs/security.md did, and migrated on. The roles are
/// dropped before the answer: they are the cluster's, not the test
/// database's.
async fn privileges_after_migrating<const N: usize>(
    pool: &PgPool,
    version: i64,
    roles: &[&str; N],
    grants: impl FnOnce(&[String; N]) -> String,
    table: &str,
    privileges: &[&str],
) -> Vec<bool> {
    migrate_to(pool, version).await;
    let tag = uuid::Uuid::new_v4().simple();
    let names: [String; N] = roles.map(|r| format!("durastep_{r}_{tag}"));
    let create: String = names.iter().map(|n| format!("CREATE ROLE {n}; ")).collect();
    sqlx::raw_sql(sqlx::AssertSqlSafe(create + &grants(&names)))
        .execute(pool)
        .await
        .expect("the roles and the grants of the earlier recipe");
    durastep::migrate(pool).await.expect("migrate on");
    let mut granted = Vec::new();
    for role in names.iter().map(String::as_str).chain(["public"]) {
        for privilege in privileges {
            let has: bool = sqlx::query_scalar("SELECT has_table_privilege($1, $2, $3)")
                .bind(role)
                .bind(table)
                .bind(privilege)
                .fetch_one(pool)
                .await
                .expect("privilege");
            granted.push(has);
        }
    }
    for name in &names {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP OWNED BY {name}; DROP ROLE {name}")))
            .execute(pool)
            .await
            .expect("drop the roles");
    }
    granted
}

/// Catches: a deployment's readers of the run history that cannot read
/// its timeline after migration 0044 (`durastep.run_timeline` is a new view,
/// which no role but its owner reads until granted): 0044 gives `SELECT` on
/// it to every role that reads `run_history`, and to no other. Two roles as
/// docs/security.md's recipe of 0043 grants them (one reads the history,
/// one only `runs`), then it is migrated on. Checked: without 0044's grants
/// block, the history's reader cannot read the view.
#[sqlx::test(migrations = false)]
async fn the_timeline_takes_the_readers_of_the_history(pool: PgPool) {
    let granted = privileges_after_migrating(
        &pool,
        43,
        &["app", "other"],
        |[app, other]| {
            format!(
                "GRANT SELECT, INSERT, DELETE ON durastep.run_history TO {app};
                 GRANT SELECT ON durastep.runs TO {other}"
            )
        },
        "durastep.run_timeline",
        &["SELECT"],
    )
    .await;
    assert_eq!(granted, [true, false, false], "(the history's reader, the runs' reader, PUBLIC)");
}

/// Catches: a deployment whose workers cannot complete runs after migration
/// 0045 (every completion adds to `durastep.completions_per_minute`, a new
/// table no role but its owner may write until granted), or whose readers
/// cannot read the per-minute counts: 0045 grants it as `run_history` is
/// granted (INSERT there gives INSERT and UPDATE, the completion's upsert;
/// SELECT and DELETE as they are), and to no other role. Three roles as
/// docs/security.md's recipe of 0044 grants them (the app, a reader of
/// every table, one that reads only `runs`), then it is migrated on.
/// Checked: without 0045's grants block, the app cannot insert.
#[sqlx::test(migrations = false)]
async fn the_minute_counts_take_the_grants_of_the_history(pool: PgPool) {
    let granted = privileges_after_migrating(
        &pool,
        44,
        &["app", "reader", "other"],
        |[app, reader, other]| {
            format!(
                "GRANT SELECT, INSERT, DELETE ON durastep.run_history TO {app};
                 GRANT SELECT ON durastep.run_history TO {reader};
                 GRANT SELECT ON durastep.runs TO {other}"
            )
        },
        "durastep.completions_per_minute",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
    )
    .await;
    assert_eq!(
        granted,
        [true, true, true, true, true, false, false, false, false, false, false, false, false, false, false, false],
        "(app, reader, the runs' reader, PUBLIC: S I U D)"
    );
}

/// Catches: a `durastep.now()` that Postgres cannot inline (PL/pgSQL, as
/// from migration 0019 to 0038; a SQL body that reads a table; a `SET`
/// clause), so that every statement calls it again, per row where it sits in
/// a row's expression: its six calls were about a tenth of a one-event
/// send's server instructions (migration 0039). With function statistics on,
/// a send counts its own call and none of `durastep.now()`.
#[sqlx::test(migrations = false)]
async fn the_clock_is_inlined_into_the_statements_that_read_it(pool: PgPool) {
    durastep::migrate(&pool).await.expect("migrate");
    sqlx::query("INSERT INTO durastep.functions (id, triggers, max_attempts) VALUES ('f', ARRAY['go'], 3)")
        .execute(&pool)
        .await
        .expect("a function");
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SET LOCAL track_functions = 'all'").execute(&mut *tx).await.expect("track functions");
    for _ in 0..2 {
        sqlx::query(
            "SELECT count(*) FROM durastep.send_events(ARRAY[gen_random_uuid()], ARRAY['go'], ARRAY['{}'],
                                                       ARRAY[NULL::text], ARRAY[NULL::timestamptz], ARRAY[0])",
        )
        .execute(&mut *tx)
        .await
        .expect("send");
    }
    let (sends, clocks): (i64, i64) = sqlx::query_as(
        "SELECT pg_stat_get_xact_function_calls('durastep.send_events'::regproc),
                coalesce(pg_stat_get_xact_function_calls('durastep.now'::regproc), 0)",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("function statistics");
    assert_eq!((sends, clocks), (2, 0), "(calls of send_events, calls of durastep.now())");
}

/// Catches: a kept plan that keeps the clock it was made with. Since
/// migration 0039 the test clock's offset is a constant inlined into each
/// plan, and moving the clock defines `durastep.now()` again, which must
/// make Postgres plan again every kept plan that read it: a prepared
/// statement's generic plan and a PL/pgSQL function's alike (each executed
/// more than five times first, so that the generic plan is the one kept).
#[sqlx::test(migrations = false)]
async fn moving_the_clock_reaches_plans_kept_before(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, vec![]).await;
    let mut conn = sqlx::PgConnection::connect_with(&opts).await.expect("connect");
    sqlx::query(
        "CREATE FUNCTION pg_temp.offset_in_plpgsql() RETURNS double precision LANGUAGE plpgsql AS $$
         BEGIN RETURN extract(epoch FROM durastep.now() - now()); END $$",
    )
    .execute(&mut conn)
    .await
    .expect("a PL/pgSQL function");
    async fn offsets(conn: &mut sqlx::PgConnection) -> (f64, f64) {
        sqlx::query_as(
            "SELECT extract(epoch FROM durastep.now() - now())::float8, pg_temp.offset_in_plpgsql()
               FROM durastep.clock WHERE offset_max >= $1::interval",
        )
        .bind(chrono::TimeDelta::zero())
        .fetch_one(conn)
        .await
        .expect("the clock's offset")
    }
    for _ in 0..8 {
        assert_eq!(offsets(&mut conn).await, (0.0, 0.0));
    }
    durastep::testing::advance_clock(&engine, std::time::Duration::from_secs(3_600)).await.expect("advance");
    assert_eq!(offsets(&mut conn).await, (3_600.0, 3_600.0));
    // Moved by plain SQL too, backwards, and with a fraction of a second.
    sqlx::query("UPDATE durastep.clock SET offset_by = interval '-1 day 2 hours 0.25 seconds'")
        .execute(engine.pool())
        .await
        .expect("move the clock by SQL");
    let back = -86_400.0 + 7_200.25;
    assert_eq!(offsets(&mut conn).await, (back, back));
}

/// Catches: a state or entry kind outside the lists that a write could
/// store (docs/architecture.md "Names checked by enum types": refused by the
/// cast's error, SQLSTATE 22P02), a step's row that the kind check would
/// refuse, or stored rows that the constraints
/// (added `NOT VALID` by migration 0040) would not pass when validated
/// (docs/operations.md).
#[sqlx::test(migrations = false)]
async fn names_outside_the_lists_are_refused_and_stored_rows_pass(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("checked")
        .on_event("checked/go")
        .handler(|ctx: Ctx, n: u32| async move { ctx.step("one", || async move { Ok(n + 1) }).await });
    let engine = common::engine(&opts, vec![f]).await;
    let run = engine.send(Event::new("checked/go", &1)).await.expect("send").run_ids[0];
    let w = common::spawn_worker(&engine);
    common::finished(&engine, run).await;
    w.stop().await;
    let pool = engine.pool();
    for (sql, what) in [
        ("UPDATE durastep.runs SET state = 'paused' WHERE id = $1", "a state outside the list"),
        ("UPDATE durastep.step_results SET kind = 'nap' WHERE run_id = $1", "a step row's kind outside the list"),
        (
            "INSERT INTO durastep.step_journal (run_id, position, kind, step_key) VALUES ($1, 9, 'nap', 'x')",
            "a journal entry's kind outside the list",
        ),
    ] {
        let err = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(run).execute(pool).await.expect_err(what);
        let code = err.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("22P02"), "{what}: {err}");
    }
    // Nothing stored was changed; the step's row has its journal entry.
    let state: RunState = sqlx::query_scalar("SELECT state FROM durastep.runs WHERE id = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .expect("the run");
    assert_eq!(state, RunState::Completed);
    let (position, kind): (Option<i32>, Option<String>) =
        sqlx::query_as("SELECT position, kind FROM durastep.step_results WHERE run_id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .expect("the step row");
    assert_eq!((position, kind.as_deref()), (Some(0), Some("step")));
    for (table, constraint) in [
        ("runs", "runs_state_check"),
        ("step_results", "step_results_entry"),
        ("step_journal", "step_journal_kind_check"),
    ] {
        let sql = format!("ALTER TABLE durastep.{table} VALIDATE CONSTRAINT {constraint}");
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await.unwrap_or_else(|e| panic!("{constraint}: {e}"));
    }
}
