//! The example's error type.

/// What can go wrong outside a run: the database, the engine, a simulator, the command line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A query of the state store failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The state store's migrations failed.
    #[error("migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The Durastep engine refused or failed.
    #[error("durastep: {0}")]
    Durastep(#[from] durastep::Error),
    /// A simulator could not start.
    #[error("simulator: {0}")]
    Io(#[from] std::io::Error),
    /// A platform call made outside a run failed.
    #[error(transparent)]
    Api(#[from] crate::platforms::ApiError),
    /// No Postgres to run on (nothing answers, no binaries for a throwaway one).
    #[error(transparent)]
    LocalPg(#[from] durastep_localpg::Error),
    /// A finance sheet that cannot be imported.
    #[error(transparent)]
    Sheet(#[from] crate::store::finance::SheetError),
    /// A review decision that cannot be taken.
    #[error(transparent)]
    Review(#[from] crate::store::finance::ReviewError),
    /// The command line or the environment is not usable.
    #[error("{0}")]
    Usage(String),
}
