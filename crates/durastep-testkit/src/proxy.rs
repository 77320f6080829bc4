//! A TCP proxy between worker processes and Postgres, for network faults.
//!
//! [`Proxy`] listens on `127.0.0.1:0` (one or more listeners) and forwards
//! every connection to the real server. Each listener has a [`Mode`] that can
//! be switched while the workers run:
//!
//! - [`Mode::Pass`]: bytes flow both ways.
//! - [`Mode::Reset`]: entering it closes every current connection of the
//!   listener with a TCP RST, on both sides; new connections are then refused
//!   (accepted and reset at once) or passed, per `refuse_new`.
//! - [`Mode::BlackHole`]: sockets stay open (new ones are accepted too, but
//!   reach the server only after the black hole ends) and nothing is
//!   forwarded in either direction. Bytes sent meanwhile wait in the proxy,
//!   as TCP retransmission would keep them, and flow when the mode changes
//!   back, unless the new mode is a reset.
//! - [`Mode::Latency`]: every chunk is delivered that much later, in each
//!   direction (a round trip costs twice the latency).
//!
//! To cut one worker while the others pass, give each worker process its own
//! listener ([`Proxy::add_listener`], [`Proxy::url`] into
//! [`crate::WorkerConfig::database_url`]) and switch only that listener
//! ([`Proxy::set_listener_mode`]).
//!
//! The proxy also reads the Postgres protocol enough to model an **ambiguous
//! commit** ([`Proxy::cut_after_reply`]): once armed, the next execution of a
//! statement whose SQL contains a pattern is forwarded to the server, the
//! server's whole reply (up to its `ReadyForQuery`, sent after the implicit
//! commit) is swallowed, and the connection is closed: the statement committed
//! but the client sees a broken connection. The proxy answers `SSLRequest`
//! with "no" itself, so the stream it reads is always plain.
//!
//! ```no_run
//! use durastep_testkit::proxy::{Mode, Proxy};
//! use std::time::Duration;
//!
//! # async fn demo(db_url: &str) -> durastep_testkit::Result<()> {
//! let proxy = Proxy::start(db_url).await?;      // listener 0
//! let second = proxy.add_listener().await?;     // listener 1, for another worker
//! let url0 = proxy.url(0);                      // postgres://user@127.0.0.1:<port>/db
//! # let _ = url0;
//! proxy.set_mode(Mode::Latency(Duration::from_millis(200)));
//! proxy.set_listener_mode(second, Mode::BlackHole); // only listener 1 is cut
//! proxy.set_mode(Mode::Reset { refuse_new: false }); // drop every socket, accept new ones
//! proxy.set_mode(Mode::Pass);
//! proxy.cut_after_reply("INSERT INTO durastep.step_results", 1, 0);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use crate::error::{Error, Result, io};

/// What a listener does to the bytes of its connections.
///
/// ```
/// use durastep_testkit::proxy::Mode;
/// assert_ne!(Mode::Pass, Mode::BlackHole);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// Forward everything at once.
    Pass,
    /// Close every current connection (RST) on entering this mode; while in
    /// it, reset new connections at once if `refuse_new`, else pass them.
    Reset {
        /// Reset connections made while in this mode too.
        refuse_new: bool,
    },
    /// Keep the sockets, forward nothing (both directions).
    BlackHole,
    /// Deliver every chunk this long after it arrived, in each direction.
    Latency(Duration),
}

#[derive(Debug, Clone, Copy)]
struct State {
    mode: Mode,
    /// Bumped by each switch into [`Mode::Reset`]: connections of an older generation close.
    generation: u64,
}

/// The ambiguous-commit trigger, shared by every listener.
#[derive(Debug, Default)]
struct Trigger {
    pattern: Mutex<String>,
    budget: AtomicU64,
    /// Matching executions to let through after each cut (so a retry can pass).
    gap: AtomicU64,
    skip: AtomicU64,
    cuts: AtomicU64,
    committed: AtomicU64,
}

impl Trigger {
    /// Takes one unit of budget if `sql` matches the pattern.
    fn take(&self, sql: &str) -> bool {
        let pattern = self.pattern.lock().unwrap_or_else(|p| p.into_inner());
        if pattern.is_empty() || !sql.contains(pattern.as_str()) {
            return false;
        }
        if self.skip.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| s.checked_sub(1)).is_ok() {
            return false;
        }
        let cut = self.budget.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1)).is_ok();
        if cut {
            self.skip.store(self.gap.load(Ordering::SeqCst), Ordering::SeqCst);
        }
        cut
    }
}

struct Listener {
    addr: SocketAddr,
    state: watch::Sender<State>,
    accepted: Arc<AtomicU64>,
    _task: AbortOnDropHandle<()>,
}

/// A TCP proxy in front of one Postgres server; see the [module docs](self).
/// Dropping it stops every listener and closes every connection.
///
/// ```no_run
/// # async fn demo(url: &str) -> durastep_testkit::Result<()> {
/// let proxy = durastep_testkit::proxy::Proxy::start(url).await?;
/// println!("workers connect to {}", proxy.url(0));
/// # Ok(()) }
/// ```
pub struct Proxy {
    upstream: String,
    user: String,
    database: String,
    trigger: Arc<Trigger>,
    listeners: Mutex<Vec<Arc<Listener>>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addrs: Vec<SocketAddr> = self.lock().iter().map(|l| l.addr).collect();
        f.debug_struct("Proxy").field("upstream", &self.upstream).field("listeners", &addrs).finish()
    }
}

impl Proxy {
    /// A proxy in front of the server of `db_url` (a `postgres://` URL), with
    /// one listener (index 0) in [`Mode::Pass`].
    ///
    /// ```no_run
    /// # async fn demo() -> durastep_testkit::Result<()> {
    /// let proxy = durastep_testkit::proxy::Proxy::start("postgres://postgres@127.0.0.1:5432/t1").await?;
    /// assert!(proxy.url(0).ends_with("/t1"));
    /// # Ok(()) }
    /// ```
    pub async fn start(db_url: &str) -> Result<Proxy> {
        let opts: PgConnectOptions = db_url.parse()?;
        let proxy = Proxy {
            upstream: format!("{}:{}", opts.get_host(), opts.get_port()),
            user: opts.get_username().to_owned(),
            database: opts.get_database().unwrap_or("postgres").to_owned(),
            trigger: Arc::default(),
            listeners: Mutex::new(Vec::new()),
        };
        proxy.add_listener().await?;
        Ok(proxy)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Listener>>> {
        self.listeners.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn listener(&self, i: usize) -> Arc<Listener> {
        Arc::clone(&self.lock()[i])
    }

    /// Opens one more listener (in [`Mode::Pass`]) on a free port; returns its index.
    ///
    /// ```no_run
    /// # async fn demo(proxy: &durastep_testkit::proxy::Proxy) -> durastep_testkit::Result<()> {
    /// let i = proxy.add_listener().await?;
    /// assert_ne!(proxy.url(i), proxy.url(0));
    /// # Ok(()) }
    /// ```
    pub async fn add_listener(&self) -> Result<usize> {
        let socket = TcpListener::bind("127.0.0.1:0").await.map_err(io("binding the proxy"))?;
        let addr = socket.local_addr().map_err(io("proxy address"))?;
        let (state, _) = watch::channel(State { mode: Mode::Pass, generation: 0 });
        let accepted = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(accept_loop(
            socket,
            self.upstream.clone(),
            state.clone(),
            Arc::clone(&self.trigger),
            Arc::clone(&accepted),
        ));
        let listener = Arc::new(Listener { addr, state, accepted, _task: AbortOnDropHandle::new(task) });
        let mut all = self.lock();
        all.push(listener);
        Ok(all.len() - 1)
    }

    /// How many listeners there are.
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) { assert!(proxy.listeners() >= 1); }
    /// ```
    pub fn listeners(&self) -> usize {
        self.lock().len()
    }

    /// The address of listener `i`. Panics if there is none.
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) { println!("{}", proxy.addr(0)); }
    /// ```
    pub fn addr(&self, i: usize) -> SocketAddr {
        self.listener(i).addr
    }

    /// The database URL through listener `i` (same user and database as the
    /// URL the proxy was started with).
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) {
    /// let w = durastep_testkit::WorkerConfig::default().database_url(proxy.url(0));
    /// # let _ = w; }
    /// ```
    pub fn url(&self, i: usize) -> String {
        let addr = self.addr(i);
        format!("postgres://{}@{}:{}/{}", self.user, addr.ip(), addr.port(), self.database)
    }

    /// Switches every listener to `mode`.
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) {
    /// proxy.set_mode(durastep_testkit::proxy::Mode::BlackHole);
    /// # }
    /// ```
    pub fn set_mode(&self, mode: Mode) {
        for i in 0..self.listeners() {
            self.set_listener_mode(i, mode);
        }
    }

    /// Switches listener `i` to `mode` (entering [`Mode::Reset`] closes its connections).
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) {
    /// proxy.set_listener_mode(1, durastep_testkit::proxy::Mode::Reset { refuse_new: true });
    /// # }
    /// ```
    pub fn set_listener_mode(&self, i: usize, mode: Mode) {
        self.listener(i).state.send_modify(|s| {
            if matches!(mode, Mode::Reset { .. }) {
                s.generation += 1;
            }
            s.mode = mode;
        });
    }

    /// The current mode of listener `i`.
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) {
    /// assert_eq!(proxy.mode(0), durastep_testkit::proxy::Mode::Pass);
    /// # }
    /// ```
    pub fn mode(&self, i: usize) -> Mode {
        self.listener(i).state.borrow().mode
    }

    /// Connections accepted so far by listener `i`.
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) { println!("{}", proxy.accepted(0)); }
    /// ```
    pub fn accepted(&self, i: usize) -> u64 {
        self.listener(i).accepted.load(Ordering::SeqCst)
    }

    /// Arms the ambiguous-commit cut: the next `times` executions (Bind
    /// messages, on any listener) of a statement whose SQL contains `pattern`
    /// reach the server, their reply is swallowed and their connection closed.
    /// After each cut the next `gap` matching executions pass (so that the
    /// client's retry is not always cut too). Replaces an earlier pattern and
    /// budget; `times = 0` disarms.
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) {
    /// proxy.cut_after_reply("INSERT INTO durastep.step_results", 200, 3);
    /// # }
    /// ```
    pub fn cut_after_reply(&self, pattern: &str, times: u64, gap: u64) {
        *self.trigger.pattern.lock().unwrap_or_else(|p| p.into_inner()) = pattern.to_owned();
        self.trigger.gap.store(gap, Ordering::SeqCst);
        self.trigger.skip.store(0, Ordering::SeqCst);
        self.trigger.budget.store(times, Ordering::SeqCst);
    }

    /// Connections cut by [`Proxy::cut_after_reply`] so far, and how many of
    /// them had a reply that reported success (the statement completed, no
    /// error, and the server was idle after it: committed).
    ///
    /// ```no_run
    /// # fn demo(proxy: &durastep_testkit::proxy::Proxy) {
    /// let (cuts, committed) = proxy.cuts();
    /// assert!(committed <= cuts);
    /// # }
    /// ```
    pub fn cuts(&self) -> (u64, u64) {
        (self.trigger.cuts.load(Ordering::SeqCst), self.trigger.committed.load(Ordering::SeqCst))
    }
}

async fn accept_loop(
    socket: TcpListener,
    upstream: String,
    state: watch::Sender<State>,
    trigger: Arc<Trigger>,
    accepted: Arc<AtomicU64>,
) {
    // Connection tasks end when their listener is dropped (this task is aborted).
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((client, _)) = socket.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        accepted.fetch_add(1, Ordering::SeqCst);
        while conns.try_join_next().is_some() {}
        let rx = state.subscribe();
        if matches!(rx.borrow().mode, Mode::Reset { refuse_new: true }) {
            let _ = client.set_zero_linger();
            drop(client);
            continue;
        }
        conns.spawn(serve(client, upstream.clone(), rx, Arc::clone(&trigger)));
    }
}

/// Per-connection protocol state shared by its two directions.
#[derive(Default)]
struct Conn {
    /// Prepared statement name -> SQL.
    statements: Mutex<HashMap<String, String>>,
    /// The server's reply is to be swallowed and the connection cut.
    armed: AtomicBool,
}

async fn serve(mut client: TcpStream, upstream: String, mut state: watch::Receiver<State>, trigger: Arc<Trigger>) {
    // In a black hole even the connection attempt goes nowhere: reach the
    // server only once the mode lets bytes through (no idle backend piles up).
    while state.borrow().mode == Mode::BlackHole {
        if state.changed().await.is_err() {
            return;
        }
    }
    let generation = state.borrow().generation;
    if matches!(state.borrow().mode, Mode::Reset { refuse_new: true }) {
        let _ = client.set_zero_linger();
        return;
    }
    let Ok(mut server) = TcpStream::connect(&upstream).await else {
        let _ = client.set_zero_linger();
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // Every close is an abortive one (RST): a reset drops both sockets, and
    // so does the end of either direction (nothing more is owed to the other side).
    let _ = client.set_zero_linger();
    let _ = server.set_zero_linger();
    // The untyped startup messages: answer SSL/GSS requests "no", forward the rest.
    if startup(&mut client, &mut server).await.is_err() {
        return;
    }
    let conn = Arc::new(Conn::default());
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, state.clone(), Direction::ToServer, Arc::clone(&conn), Arc::clone(&trigger));
    let down = pump(sr, cw, state.clone(), Direction::ToClient, conn, trigger);
    let reset = async {
        while state.changed().await.is_ok() {
            if state.borrow().generation != generation {
                return;
            }
        }
        std::future::pending::<()>().await;
    };
    // Whichever ends first drops everything: both sockets close with a RST.
    tokio::select! {
        () = up => {}
        () = down => {}
        () = reset => {}
    }
}

const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

async fn startup(client: &mut TcpStream, server: &mut TcpStream) -> std::io::Result<()> {
    loop {
        let len = client.read_u32().await?;
        if !(8..=10_000).contains(&len) {
            return Err(std::io::Error::other("bad startup length"));
        }
        let mut body = vec![0; len as usize - 4];
        client.read_exact(&mut body).await?;
        let code = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
        if code == SSL_REQUEST || code == GSSENC_REQUEST {
            client.write_all(b"N").await?;
            continue;
        }
        server.write_all(&len.to_be_bytes()).await?;
        server.write_all(&body).await?;
        return Ok(());
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToServer,
    ToClient,
}

/// Splits a stream of typed protocol messages (tag byte, 4-byte length
/// including itself, body). Keeps the bodies of the messages it is asked to.
#[derive(Default)]
struct Framer {
    header: Vec<u8>,
    tag: u8,
    left: usize,
    keep: bool,
    body: Vec<u8>,
}

impl Framer {
    /// Feeds bytes; calls `done(tag, body)` for each complete message
    /// (`body` is empty unless `keep(tag)`).
    fn feed(&mut self, mut data: &[u8], keep: impl Fn(u8) -> bool, mut done: impl FnMut(u8, &[u8])) {
        while !data.is_empty() {
            if self.left == 0 && self.header.len() < 5 {
                let take = (5 - self.header.len()).min(data.len());
                self.header.extend_from_slice(&data[..take]);
                data = &data[take..];
                if self.header.len() < 5 {
                    return;
                }
                self.tag = self.header[0];
                let len = u32::from_be_bytes([self.header[1], self.header[2], self.header[3], self.header[4]]);
                self.left = (len as usize).saturating_sub(4);
                self.keep = keep(self.tag);
                self.body.clear();
                if self.left == 0 {
                    done(self.tag, &[]);
                    self.header.clear();
                }
                continue;
            }
            let take = self.left.min(data.len());
            if self.keep {
                self.body.extend_from_slice(&data[..take]);
            }
            data = &data[take..];
            self.left -= take;
            if self.left == 0 {
                done(self.tag, &self.body);
                self.header.clear();
                self.body.clear();
            }
        }
    }
}

/// The first `n` NUL-terminated strings of a message body.
fn cstrings(body: &[u8], n: usize) -> Vec<String> {
    body.split(|&b| b == 0).take(n).map(|s| String::from_utf8_lossy(s).into_owned()).collect()
}

/// Forwards one direction under the listener's mode, until either side closes
/// (or, on the server side of an armed connection, the swallowed reply ends).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    state: watch::Receiver<State>,
    direction: Direction,
    conn: Arc<Conn>,
    trigger: Arc<Trigger>,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(64);
    let mut read_state = state.clone();
    let reader = async move {
        let mut framer = Framer::default();
        // Server side of an armed connection: (saw CommandComplete, saw ErrorResponse).
        let mut reply = (false, false);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // Black hole: read nothing until the mode changes.
            while read_state.borrow().mode == Mode::BlackHole {
                if read_state.changed().await.is_err() {
                    return;
                }
            }
            let n = tokio::select! {
                n = from.read(&mut buf) => match n {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                },
                changed = read_state.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let data = &buf[..n];
            match direction {
                Direction::ToServer => framer.feed(
                    data,
                    |tag| tag == b'P' || tag == b'B',
                    |tag, body| match tag {
                        b'P' => {
                            let s = cstrings(body, 2);
                            if let [name, sql] = s.as_slice() {
                                conn.statements
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .insert(name.clone(), sql.clone());
                            }
                        }
                        b'B' => {
                            let s = cstrings(body, 2);
                            if let [_portal, name] = s.as_slice() {
                                let sql = conn.statements.lock().unwrap_or_else(|p| p.into_inner()).get(name).cloned();
                                if sql.is_some_and(|sql| trigger.take(&sql)) {
                                    // Set before the Bind is forwarded: the reply comes after.
                                    conn.armed.store(true, Ordering::SeqCst);
                                }
                            }
                        }
                        _ => {}
                    },
                ),
                Direction::ToClient if conn.armed.load(Ordering::SeqCst) => {
                    // Swallow the reply; cut at its ReadyForQuery.
                    let mut ready = false;
                    framer.feed(
                        data,
                        |_| false,
                        |tag, _| match tag {
                            b'C' => reply.0 = true,
                            b'E' => reply.1 = true,
                            b'Z' => ready = true,
                            _ => {}
                        },
                    );
                    if ready {
                        trigger.cuts.fetch_add(1, Ordering::SeqCst);
                        if reply == (true, false) {
                            trigger.committed.fetch_add(1, Ordering::SeqCst);
                        }
                        return;
                    }
                    continue;
                }
                Direction::ToClient => framer.feed(data, |_| false, |_, _| {}),
            }
            let delay = match read_state.borrow().mode {
                Mode::Latency(d) => d,
                _ => Duration::ZERO,
            };
            if tx.send((Instant::now() + delay, data.to_vec())).await.is_err() {
                return;
            }
        }
    };
    let mut write_state = state;
    let writer = async {
        while let Some((at, data)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            while write_state.borrow().mode == Mode::BlackHole {
                if write_state.changed().await.is_err() {
                    return;
                }
            }
            if to.write_all(&data).await.is_err() {
                return;
            }
        }
    };
    // Whichever side ends first ends the direction (the reader drops the
    // sender when it ends, so the writer flushes what is queued, then ends).
    tokio::join!(reader, writer);
}

impl Proxy {
    /// Waits until listener `i` has accepted at least `n` connections in all.
    ///
    /// ```no_run
    /// # async fn demo(proxy: &durastep_testkit::proxy::Proxy) -> durastep_testkit::Result<()> {
    /// proxy.wait_accepted(0, 1, std::time::Duration::from_secs(5)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn wait_accepted(&self, i: usize, n: u64, timeout: Duration) -> Result<()> {
        let listener = self.listener(i);
        crate::wait_for(&format!("{n} connections on proxy listener {i}"), timeout, || {
            let got = listener.accepted.load(Ordering::SeqCst);
            async move { Ok::<_, Error>((got >= n).then_some(())) }
        })
        .await
    }
}
