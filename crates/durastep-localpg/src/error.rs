//! The crate's one error type.

/// What can go wrong while finding, starting or stopping a local cluster.
///
/// ```
/// let e = durastep_localpg::Error::NoServer { address: "127.0.0.1:5432".into() };
/// assert!(e.to_string().contains("install"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Nothing answers at the address and no server binaries are installed.
    #[error(
        "nothing answers at {address} and no PostgreSQL server binaries (initdb, pg_ctl) were found on PATH, through \
         pg_config or in /usr/lib/postgresql/*/bin: install PostgreSQL (Debian/Ubuntu: apt-get install postgresql; \
         macOS: brew install postgresql) or set DATABASE_URL to a Postgres you can use"
    )]
    NoServer {
        /// `host:port` of the URL that was tried.
        address: String,
    },
    /// The directory named by `DURASTEP_PG_BIN` holds no `initdb` and `pg_ctl`.
    #[error("DURASTEP_PG_BIN={dir} holds no initdb and pg_ctl")]
    BadBinDir {
        /// The directory.
        dir: String,
    },
    /// The URL is not a `postgres://` URL this crate can read.
    #[error("not a postgres:// URL: {0}")]
    BadUrl(String),
    /// Running a program or touching a file failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A Postgres tool exited with an error.
    #[error("{tool} failed ({status}): {output}")]
    Tool {
        /// The program (`initdb`, `pg_ctl`, `createdb`).
        tool: String,
        /// Its exit status.
        status: String,
        /// Its output and the end of the server log.
        output: String,
    },
}

/// The crate's result type.
///
/// ```
/// fn f() -> durastep_localpg::Result<u8> { Ok(1) }
/// assert_eq!(f().unwrap(), 1);
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}
