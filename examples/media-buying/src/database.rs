//! Connecting: the demo's own database, its pools, and an engine
//! with every function registered and both schemas migrated.

use std::sync::Arc;

use durastep::{Engine, WorkerOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use crate::functions::{self, Services};
use crate::{Error, Settings, store};

/// The server the demo uses when `DATABASE_URL` is not set.
pub const DEFAULT_URL: &str = durastep_localpg::DEFAULT_URL;

/// `DATABASE_URL`, or [`DEFAULT_URL`].
pub fn server_url() -> String {
    durastep_localpg::database_url()
}

/// The server of [`server_url`]; when nothing answers at that (local)
/// address, a throwaway cluster from the installed server binaries, announced
/// on stderr and removed when the handle drops. Keep the handle while you use it.
pub async fn server() -> Result<durastep_localpg::LocalDatabase, Error> {
    let server = durastep_localpg::LocalDatabase::resolve(&server_url()).await?;
    if let Some(notice) = server.notice() {
        eprintln!("{notice}");
    }
    Ok(server)
}

/// Drops and recreates database `name` on the server at `url` (so that every
/// demo starts from nothing); returns its connect options.
pub async fn fresh_database(url: &str, name: &str) -> Result<PgConnectOptions, Error> {
    let server: PgConnectOptions = url.parse()?;
    let mut conn = PgConnection::connect_with(&server).await.map_err(|e| {
        Error::Usage(format!("cannot reach Postgres at {url}: {e}\n(set DATABASE_URL to a Postgres you can use)"))
    })?;
    // The name is ours (a constant), never user input: safe to splice.
    sqlx::query(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))).execute(&mut conn).await?;
    sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&mut conn).await?;
    conn.close().await?;
    Ok(server.database(name))
}

/// A pool on the demo's database.
pub async fn pool(options: PgConnectOptions, max_connections: u32) -> Result<PgPool, Error> {
    Ok(PgPoolOptions::new().max_connections(max_connections).connect_with(options).await?)
}

/// An engine on `pool` with every function of the example registered;
/// migrates Durastep's schema, then the state store's.
pub async fn engine(pool: PgPool, settings: Settings, worker: WorkerOptions) -> Result<(Engine, Arc<Services>), Error> {
    let services = Services::new(pool.clone(), settings);
    let mut builder = Engine::builder().pool(pool.clone()).worker_options(worker);
    for f in functions::all(&services) {
        builder = builder.function(f);
    }
    let engine = builder.build().await?;
    store::migrate(&pool).await?;
    Ok((engine, services))
}
