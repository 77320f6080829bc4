//! # The Durastep web dashboard
//!
//! Server-rendered pages over Durastep's inspection API
//! ([`durastep::Engine::inspect`]): an overview (runs per function and state,
//! runs per minute over the last hour, what holds the runs that are not
//! running, recent failures), the run list with filters and cursor pagination,
//! one run with its event, executions, step timeline and "why is it not
//! running", and replay and cancel buttons. No JavaScript; no SQL of its own.
//!
//! ```no_run
//! use durastep_dashboard::{DashboardConfig, serve};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn demo(engine: durastep::Engine) -> Result<(), durastep_dashboard::DashboardError> {
//! let mut config = DashboardConfig::default(); // 127.0.0.1:7070, no token
//! config.token = std::env::var("DURASTEP_DASHBOARD_TOKEN").ok();
//! serve(engine, config, CancellationToken::new()).await
//! # }
//! ```
//!
//! ## Security
//!
//! - It binds to loopback by default; [`serve`] and [`router`] refuse a
//!   non-loopback address without a token ([`DashboardError::TokenRequired`]).
//! - It answers only to the host names it is served as (loopback names, the
//!   configured address, and [`DashboardConfig::allowed_hosts`]); any other
//!   `Host` gets 421 before any handler runs, so a web page that rebinds its
//!   own name to 127.0.0.1 cannot read or drive it.
//! - With a token, every page requires it: a browser logs in at `/login` (a
//!   new random `HttpOnly; SameSite=Strict` session per login, expiring after
//!   [`DashboardConfig::session_ttl`], ended by the Log out button; `Secure`
//!   with the `__Host-` prefix when [`DashboardConfig::behind_tls`]), a script
//!   sends `Authorization: Bearer <token>`. Failed logins are limited to 5 a
//!   minute; secrets are compared in constant time (`subtle`).
//! - Step outputs, run outputs, event data, idempotency keys, flow keys and
//!   error texts are shown only with a token configured (so only to
//!   authenticated requests), or in loopback mode when
//!   [`DashboardConfig::show_data`] is set.
//! - Replay and cancel are POST forms carrying a CSRF token (random per
//!   process); a POST without it, or from another origin, gets 403 and changes
//!   nothing. Responses forbid framing and scripts (Content-Security-Policy).
//! - Served from an [`Inspector`] (a reader connection, see
//!   [`Inspector::connect`]) or with [`DashboardConfig::read_only`], it has no
//!   actions at all.
//! - It speaks plain HTTP: put it behind a TLS proxy before exposing it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use durastep::Engine;
use durastep::inspect::Inspector;
use tokio_util::sync::CancellationToken;

mod actions;
mod auth;
mod html;
mod pages;

/// The shortest access token accepted.
pub const MIN_TOKEN_LEN: usize = 16;

/// How to run the dashboard. Build one with [`DashboardConfig::new`] or
/// `Default` (127.0.0.1:7070), then set the public fields.
///
/// ```
/// let mut config = durastep_dashboard::DashboardConfig::new("127.0.0.1:8080".parse().unwrap());
/// config.token = Some("a-long-random-access-token".into());
/// assert!(!config.show_data);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct DashboardConfig {
    /// Where to listen. A non-loopback address requires a token.
    pub addr: SocketAddr,
    /// The access token (at least [`MIN_TOKEN_LEN`] characters). With one,
    /// every page requires it.
    pub token: Option<String>,
    /// Without a token: show step outputs, run outputs and event data anyway
    /// (default false, so no page leaks them without auth). Ignored with a
    /// token, where they are always shown to the authenticated user.
    pub show_data: bool,
    /// Seconds after which the overview reloads itself (None: never). Default 10.
    pub overview_refresh: Option<u32>,
    /// Host names (without port) the dashboard also answers to, besides
    /// `localhost`, `127.0.0.1`, `[::1]` and the address it listens on: the
    /// name a proxy or a browser uses for it. Requests for any other `Host`
    /// get 421 (DNS rebinding).
    pub allowed_hosts: Vec<String>,
    /// Browsers reach the dashboard over TLS (a TLS proxy in front): the
    /// session cookie gets `Secure` and the `__Host-` prefix. Default false.
    pub behind_tls: bool,
    /// How long a login lasts. Default 12 hours.
    pub session_ttl: Duration,
    /// No replay or cancel, even when served with an [`Engine`]. Default false.
    pub read_only: bool,
}

impl DashboardConfig {
    /// Loopback-style defaults at `addr`: no token, data hidden, overview refresh 10 s.
    ///
    /// ```
    /// let c = durastep_dashboard::DashboardConfig::new(([127, 0, 0, 1], 9000).into());
    /// assert_eq!(c.addr.port(), 9000);
    /// ```
    pub fn new(addr: SocketAddr) -> Self {
        DashboardConfig {
            addr,
            token: None,
            show_data: false,
            overview_refresh: Some(10),
            allowed_hosts: Vec::new(),
            behind_tls: false,
            session_ttl: Duration::from_secs(12 * 3600),
            read_only: false,
        }
    }
}

impl Default for DashboardConfig {
    fn default() -> Self {
        DashboardConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 7070)))
    }
}

impl std::fmt::Debug for DashboardConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DashboardConfig")
            .field("addr", &self.addr)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("show_data", &self.show_data)
            .field("overview_refresh", &self.overview_refresh)
            .field("allowed_hosts", &self.allowed_hosts)
            .field("behind_tls", &self.behind_tls)
            .field("session_ttl", &self.session_ttl)
            .field("read_only", &self.read_only)
            .finish()
    }
}

/// Why the dashboard could not start or stopped.
///
/// ```
/// let mut config = durastep_dashboard::DashboardConfig::new("0.0.0.0:7070".parse().unwrap());
/// # let engine: Option<durastep::Engine> = None;
/// # if let Some(engine) = engine {
/// let err = durastep_dashboard::router(engine, &config).unwrap_err();
/// assert!(matches!(err, durastep_dashboard::DashboardError::TokenRequired { .. }));
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DashboardError {
    /// A non-loopback address without an access token.
    #[error("refusing to serve the dashboard on {addr} without an access token (bind to loopback, or set a token)")]
    TokenRequired {
        /// The address asked for.
        addr: SocketAddr,
    },
    /// The access token is too short to resist guessing.
    #[error("the dashboard access token must be at least {min} characters long")]
    WeakToken {
        /// The minimum length, [`MIN_TOKEN_LEN`].
        min: usize,
    },
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// The server failed while serving.
    #[error("dashboard server failed: {0}")]
    Serve(#[source] std::io::Error),
}

/// What the dashboard reads from and acts through: an [`Engine`] (reads,
/// replay and cancel) or an [`Inspector`] alone (reads only, as a reader role
/// with SELECT only can serve).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let reader = durastep::inspect::Inspector::connect("postgres://durastep_reader@127.0.0.1/app").await?;
/// let source = durastep_dashboard::Source::from(reader);
/// assert!(!source.can_act());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Source {
    inspector: Inspector,
    engine: Option<Engine>,
}

impl Source {
    /// Whether replay and cancel are possible (an engine is behind it).
    ///
    /// ```no_run
    /// # fn demo(engine: durastep::Engine) {
    /// assert!(durastep_dashboard::Source::from(engine).can_act());
    /// # }
    /// ```
    pub fn can_act(&self) -> bool {
        self.engine.is_some()
    }
}

impl From<Engine> for Source {
    fn from(engine: Engine) -> Self {
        Source { inspector: engine.inspect(), engine: Some(engine) }
    }
}

impl From<Inspector> for Source {
    fn from(inspector: Inspector) -> Self {
        Source { inspector, engine: None }
    }
}

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct App {
    pub inspector: Inspector,
    /// The engine for replay and cancel; None in read-only mode.
    pub engine: Option<Engine>,
    pub access: Arc<auth::Access>,
    /// Whether outputs, event data, keys and error texts may be shown (token
    /// configured, or `show_data`).
    pub show_data: bool,
    pub overview_refresh: Option<u32>,
}

impl App {
    /// `text` when data may be shown, else a muted "hidden".
    pub(crate) fn data<'a>(&self, text: &'a str) -> &'a str {
        if self.show_data { text } else { pages::HIDDEN_VALUE }
    }
}

/// The host names the dashboard answers to.
fn host_names(config: &DashboardConfig) -> Vec<String> {
    let mut hosts: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "[::1]".into()];
    match config.addr.ip() {
        ip if ip.is_unspecified() => {}
        IpAddr::V4(ip) => hosts.push(ip.to_string()),
        IpAddr::V6(ip) => hosts.push(format!("[{ip}]")),
    }
    hosts.extend(config.allowed_hosts.iter().map(|h| h.trim().to_ascii_lowercase()).filter(|h| !h.is_empty()));
    hosts
}

fn check(config: &DashboardConfig) -> Result<(), DashboardError> {
    match &config.token {
        Some(t) if t.chars().count() < MIN_TOKEN_LEN => Err(DashboardError::WeakToken { min: MIN_TOKEN_LEN }),
        None if !config.addr.ip().is_loopback() => Err(DashboardError::TokenRequired { addr: config.addr }),
        _ => Ok(()),
    }
}

/// The dashboard's routes, ready to serve (or to nest into an application's
/// router). `config.addr` is checked (non-loopback needs a token) but not bound.
///
/// Errors: [`DashboardError::TokenRequired`], [`DashboardError::WeakToken`].
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), Box<dyn std::error::Error>> {
/// let config = durastep_dashboard::DashboardConfig::default();
/// let app = durastep_dashboard::router(engine, &config)?;
/// let listener = tokio::net::TcpListener::bind(config.addr).await?;
/// axum::serve(listener, app).await?;
/// # Ok(()) }
/// ```
pub fn router(source: impl Into<Source>, config: &DashboardConfig) -> Result<Router, DashboardError> {
    check(config)?;
    let source = source.into();
    let access = auth::AccessConfig {
        token: config.token.clone(),
        session_ttl: config.session_ttl,
        secure: config.behind_tls,
        hosts: host_names(config),
    };
    let app = App {
        inspector: source.inspector,
        engine: source.engine.filter(|_| !config.read_only),
        access: Arc::new(auth::Access::new(access)),
        show_data: config.token.is_some() || config.show_data,
        overview_refresh: config.overview_refresh,
    };
    // Layers run outermost last-added first: the Host check, then the token gate.
    Ok(Router::new()
        .route("/", get(pages::overview::show))
        .route("/runs", get(pages::runs::list))
        .route("/runs/replay", post(actions::replay_many))
        .route("/runs/{id}", get(pages::run::show))
        .route("/runs/{id}/replay", post(actions::replay))
        .route("/runs/{id}/cancel", post(actions::cancel))
        .route("/functions", get(pages::functions::list))
        .route("/login", get(auth::login_form).post(auth::login))
        .route("/logout", post(auth::logout))
        .fallback(pages::not_found)
        .layer(axum::middleware::from_fn_with_state(app.clone(), auth::gate))
        .layer(axum::middleware::from_fn_with_state(app.clone(), auth::hosts))
        .with_state(app))
}

/// Binds `config.addr`, logs the dashboard's URL, and serves until `shutdown`
/// is cancelled (then finishes the requests in flight and returns).
///
/// Errors: those of [`router`], [`DashboardError::Bind`], [`DashboardError::Serve`].
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep_dashboard::DashboardError> {
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// durastep_dashboard::serve(engine, Default::default(), shutdown).await
/// # }
/// ```
pub async fn serve(
    source: impl Into<Source>,
    config: DashboardConfig,
    shutdown: CancellationToken,
) -> Result<(), DashboardError> {
    let app = router(source, &config)?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|source| DashboardError::Bind { addr: config.addr, source })?;
    let local = listener.local_addr().map_err(DashboardError::Serve)?;
    tracing::info!(url = %format!("http://{local}/"), auth = config.token.is_some(), "durastep dashboard listening");
    axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await.map_err(DashboardError::Serve)
}
