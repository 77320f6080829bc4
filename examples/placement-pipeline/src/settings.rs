//! The example's own tables (schema `placement`): the cutover switches and
//! the chat channel of each client account. Each is a row that an operator
//! flips with one command (or one `UPDATE`), without a deploy.
//!
//! **When a switch is read.** A run reads the dry-run flag and its side
//! effect's switch once, in its first step (`mode`), and that step is
//! checkpointed: the run's record says which branch it took and why. So a run
//! created while its switch is off, and executed while it is still off,
//! completes with the output `switched_off` and sends nothing; turning the
//! switch on later does not send it (the old system still owns that side
//! effect for those stage changes). A run still queued when the switch is
//! turned on reads the new value and sends. The same holds for dry run.

use sqlx::PgPool;

use crate::side_effects::SideEffect;

/// What a run of a side effect does, decided once per run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Fire the side effect.
    Live,
    /// Record what would have been sent; fire nothing.
    DryRun,
    /// The side effect's switch is off: do nothing.
    Off,
}

/// Applies the example's migrations (schema `placement`, tracked in
/// `placement._migrations`, apart from Durastep's own).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.create_schema("placement");
    migrator.dangerous_set_table_name("placement._migrations");
    migrator.run(pool).await
}

/// Reads and flips the switches and the channel configuration.
#[derive(Clone, Debug)]
pub struct Settings {
    pool: PgPool,
}

impl Settings {
    /// Settings stored in this database (run [`migrate`] first).
    pub fn new(pool: PgPool) -> Self {
        Settings { pool }
    }

    /// What a run of `side_effect` does now: a switch that is off wins over
    /// dry run, and dry run over live.
    pub async fn mode(&self, side_effect: SideEffect) -> Result<Mode, sqlx::Error> {
        let (dry_run, enabled): (bool, bool) = sqlx::query_as(
            "SELECT s.dry_run, coalesce(w.enabled, true)
               FROM placement.settings s
               LEFT JOIN placement.switches w ON w.side_effect = $1",
        )
        .bind(side_effect.function_id())
        .fetch_one(&self.pool)
        .await?;
        Ok(match (enabled, dry_run) {
            (false, _) => Mode::Off,
            (true, true) => Mode::DryRun,
            (true, false) => Mode::Live,
        })
    }

    /// Turns dry run on or off for every side effect.
    pub async fn set_dry_run(&self, on: bool) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE placement.settings SET dry_run = $1, updated_at = now()")
            .bind(on)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Whether dry run is on.
    pub async fn dry_run(&self) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar("SELECT dry_run FROM placement.settings").fetch_one(&self.pool).await
    }

    /// Turns one side effect on or off.
    pub async fn set_switch(&self, side_effect: SideEffect, enabled: bool) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO placement.switches (side_effect, enabled) VALUES ($1, $2)
             ON CONFLICT (side_effect) DO UPDATE SET enabled = excluded.enabled, updated_at = now()",
        )
        .bind(side_effect.function_id())
        .bind(enabled)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Every side effect with whether its switch is on.
    pub async fn switches(&self) -> Result<Vec<(SideEffect, bool)>, sqlx::Error> {
        let mut out = Vec::new();
        for side_effect in SideEffect::ALL {
            let enabled: Option<bool> =
                sqlx::query_scalar("SELECT enabled FROM placement.switches WHERE side_effect = $1")
                    .bind(side_effect.function_id())
                    .fetch_optional(&self.pool)
                    .await?;
            out.push((side_effect, enabled.unwrap_or(true)));
        }
        Ok(out)
    }

    /// Sets the chat channel of a client account.
    pub async fn set_channel(&self, client_account: &str, channel: &str) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO placement.channels (client_account, channel) VALUES ($1, $2)
             ON CONFLICT (client_account) DO UPDATE SET channel = excluded.channel, updated_at = now()",
        )
        .bind(client_account)
        .bind(channel)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The chat channel of a client account, if configured.
    pub async fn channel(&self, client_account: &str) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT channel FROM placement.channels WHERE client_account = $1")
            .bind(client_account)
            .fetch_optional(&self.pool)
            .await
    }
}
