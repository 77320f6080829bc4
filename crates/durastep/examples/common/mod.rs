//! Shared by the one-concept examples (not an example itself): a fresh
//! database per example (on a throwaway cluster when no Postgres answers at
//! `DATABASE_URL` or the default address), an engine on it with short polls,
//! and a worker in the background. Read the example files for the concept; this is plumbing.
#![allow(dead_code)]

use std::time::Duration;

use durastep::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use durastep::sqlx::{self, ConnectOptions};
use durastep::{Engine, EngineBuilder, WorkerOptions};

/// What the examples return: any error, printed by `main`.
pub type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// An example's database, on the server at `DATABASE_URL` (or the local
/// default), or on a throwaway cluster when nothing answers there: keep it
/// until the end of `main` (a throwaway cluster is removed when it drops).
pub struct ExampleDb {
    /// Keeps a throwaway cluster alive.
    _server: durastep_localpg::LocalDatabase,
    pool: sqlx::PgPool,
}

impl ExampleDb {
    /// An engine builder on the database, with worker polls short enough
    /// that the example finishes in a second or two.
    pub fn builder(&self) -> EngineBuilder {
        let fast = WorkerOptions { poll_interval: Duration::from_millis(100), ..Default::default() };
        Engine::builder().pool(self.pool.clone()).worker_options(fast)
    }
}

/// Creates (or re-creates) the database `durastep_example_<name>` on the
/// server (see [`ExampleDb`]).
pub async fn fresh_db(name: &str) -> Result<ExampleDb> {
    let local = durastep_localpg::LocalDatabase::resolve_or_exit().await;
    if let Some(notice) = local.notice() {
        eprintln!("{notice}");
    }
    let server: PgConnectOptions = local.url().parse()?;
    let database = format!("durastep_example_{name}");
    let mut admin = server.clone().connect().await?;
    // The name is ours (a constant per example), not input: safe to splice.
    let drop = format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)");
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(&mut admin).await?;
    let create = format!("CREATE DATABASE {database}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(&mut admin).await?;
    let options = server.database(&database);
    let pool = PgPoolOptions::new().max_connections(8).connect_with(options).await?;
    if local.cluster().is_some() {
        println!("database {database}, on the throwaway cluster (removed at exit)");
    } else {
        let url = match local.url().rsplit_once('/') {
            Some((host, _)) => format!("{host}/{database}"),
            None => database.clone(),
        };
        println!("database {database}; it is kept: `durastep --database-url {url} runs ls` shows its runs");
    }
    Ok(ExampleDb { _server: local, pool })
}
