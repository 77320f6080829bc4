//! The example's own database on the server `DATABASE_URL` names.

use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

/// The server used when `DATABASE_URL` is not set.
pub const DEFAULT_URL: &str = durastep_localpg::DEFAULT_URL;

/// The database the demo and the commands use.
pub const DATABASE: &str = "durastep_placement_pipeline";

/// `DATABASE_URL` if set, else [`DEFAULT_URL`].
pub fn server_url() -> String {
    durastep_localpg::database_url()
}

/// Connect options for [`DATABASE`] on the server at `url`, creating it if it
/// is missing. With `fresh`, an existing one is dropped first (the demo starts
/// from nothing, so its fixed burst is not a duplicate of the last run's).
pub async fn own_database(url: &str, fresh: bool) -> Result<PgConnectOptions, sqlx::Error> {
    let server: PgConnectOptions = url.parse()?;
    let mut conn = PgConnection::connect_with(&server).await?;
    if fresh {
        sqlx::query("DROP DATABASE IF EXISTS durastep_placement_pipeline WITH (FORCE)").execute(&mut conn).await?;
    }
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(DATABASE)
        .fetch_one(&mut conn)
        .await?;
    if !exists {
        match sqlx::query("CREATE DATABASE durastep_placement_pipeline").execute(&mut conn).await {
            Ok(_) => {}
            // Created by someone else in the meantime.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
            Err(e) => return Err(e),
        }
    }
    conn.close().await?;
    Ok(server.database(DATABASE))
}
