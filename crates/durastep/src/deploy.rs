//! Safe deploys: check this build's handlers against the runs in flight, and
//! the operator's ways out for a run that diverged.
//!
//! Architecture invariant: a dry replay writes nothing. Its context has no
//! writer (a closed one) and stops (the private `Reached` signal) before every
//! path that would run a step body, write a checkpoint or a journal entry,
//! suspend, wait or start a child; it only reads what was loaded up front.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::checkpoint::Writer;
use crate::ctx::{Ctx, CtxParts, Signal};
use crate::error::{Error, from_sqlx};
use crate::journal::{Divergence, Journal};
use crate::store;
use crate::{Engine, EngineBuilder};

/// How long one run's dry replay may take before it is reported as a problem
/// (handler code outside steps that blocks).
const REPLAY_DEADLINE: Duration = Duration::from_secs(30);

/// Runs read per page.
const PAGE: i64 = 200;

/// What [`Engine::check_deploy`] found: the unfinished runs that this build's
/// code would not replay as they recorded.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let report = engine.check_deploy().await?;
/// print!("{report}");
/// std::process::exit(if report.is_safe() { 0 } else { 1 });
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct DeployReport {
    /// Unfinished runs replayed.
    pub runs_checked: u64,
    /// Diverging runs, grouped by function and position (in that order).
    pub diverging: Vec<DivergenceGroup>,
    /// Runs whose dry replay could not tell (the handler panicked, failed on a
    /// stored result, or did not stop in time): look at them before deploying.
    pub problems: Vec<ReplayProblem>,
    /// Unfinished runs of a function this build registers, started under a
    /// version it has no handler for, by function and version: this build's
    /// workers would not claim them (see [`crate::FunctionBuilder::version`]).
    /// Keep registering that version's handler (here or in workers that stay
    /// up) until they drain.
    pub unhandled: Vec<UnhandledVersion>,
}

impl DeployReport {
    /// Whether no run diverges and every run could be replayed.
    ///
    /// ```
    /// assert!(durastep::DeployReport::default().is_safe());
    /// ```
    pub fn is_safe(&self) -> bool {
        self.diverging.is_empty() && self.problems.is_empty() && self.unhandled.is_empty()
    }

    /// How many runs diverge, in all groups.
    ///
    /// ```
    /// assert_eq!(durastep::DeployReport::default().diverging_runs(), 0);
    /// ```
    pub fn diverging_runs(&self) -> u64 {
        self.diverging.iter().map(|g| g.runs).sum()
    }
}

impl fmt::Display for DeployReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "checked {} unfinished runs: {} diverge, {} could not be replayed",
            self.runs_checked,
            self.diverging_runs(),
            self.problems.len()
        )?;
        for g in &self.diverging {
            writeln!(f, "  {} at position {}: {} runs, e.g. {}", g.function_id, g.position, g.runs, g.example)?;
        }
        for p in &self.problems {
            writeln!(f, "  {} run {}: {}", p.function_id, p.run_id, p.problem)?;
        }
        for u in &self.unhandled {
            writeln!(
                f,
                "  {} version {}: {} runs, and this build has no handler for that version (e.g. {})",
                u.function_id, u.version, u.runs, u.example
            )?;
        }
        Ok(())
    }
}

/// The runs of one function that diverge at one position.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for g in engine.check_deploy().await?.diverging {
///     eprintln!("{} runs of {} diverge at {}: {}", g.runs, g.function_id, g.position, g.example);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct DivergenceGroup {
    /// The function.
    pub function_id: String,
    /// The position where they part.
    pub position: u32,
    /// How many runs.
    pub runs: u64,
    /// One of them.
    pub example: Divergence,
}

/// The unfinished runs of one function started under a version the checked
/// build has no handler for.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for u in engine.check_deploy().await?.unhandled {
///     eprintln!("keep the handler of {} version {}: {} runs left", u.function_id, u.version, u.runs);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct UnhandledVersion {
    /// The function.
    pub function_id: String,
    /// The version its runs started under.
    pub version: u32,
    /// How many unfinished runs.
    pub runs: u64,
    /// One of them.
    pub example: Uuid,
}

/// A run whose dry replay could not tell whether it diverges.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for p in engine.check_deploy().await?.problems { eprintln!("{}: {}", p.run_id, p.problem); }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ReplayProblem {
    /// The run.
    pub run_id: Uuid,
    /// Its function.
    pub function_id: String,
    /// What happened.
    pub problem: String,
}

/// How one dry replay ended.
enum DryOutcome {
    Fits,
    Diverged(Divergence),
    Problem(String),
    /// The build has no handler for the run's version.
    Unhandled,
}

impl EngineBuilder {
    /// Checks this build's functions against the runs in flight, as
    /// [`Engine::check_deploy`] does, without building an engine: it validates
    /// the functions and connects, but does not migrate and registers nothing
    /// (the live function definitions, flow rules and schedules stay those of
    /// the deployed build), and it sends only `SELECT`s. So it runs before the
    /// deploy, as the reader role of docs/security.md. The migration setting
    /// and worker options are ignored.
    ///
    /// Errors: those of [`EngineBuilder::build`] for invalid functions or an
    /// unreachable database, and [`Error::Database`] when the schema is missing
    /// or older than this build's (a check needs this build's migrations applied).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), durastep::Error> {
    /// let billing = durastep::Function::new("billing")
    ///     .on_event("invoice/due")
    ///     .handler(|ctx: durastep::Ctx, id: u64| async move { ctx.step("charge", || async move { Ok(id) }).await });
    /// let report = durastep::Engine::builder()
    ///     .database_url("postgres://durastep_reader@127.0.0.1/app")
    ///     .function(billing)
    ///     .check_deploy()
    ///     .await?;
    /// std::process::exit(if report.is_safe() { 0 } else { 1 });
    /// # }
    /// ```
    pub async fn check_deploy(self) -> Result<DeployReport, Error> {
        self.connect_unregistered().await?.check_deploy().await
    }
}

impl Engine {
    /// Replays every unfinished run (queued, running, sleeping, waiting or
    /// diverged) of every function registered in this engine against this
    /// build's handler of the run's version, without side effects, and reports
    /// the runs that would diverge, grouped by function and position, with one
    /// example each, and the runs of versions this build has no handler for.
    ///
    /// A dry replay returns stored results, stops at the first entry the run
    /// did not record (no step body runs, nothing is written, nothing is
    /// claimed), and compares what the handler asks for at each position with
    /// what the run recorded. Code outside steps does run: it must be
    /// deterministic and free of side effects, as for any replay. Runs of
    /// functions this build does not register are not checked. Before a
    /// deploy, run it through [`EngineBuilder::check_deploy`](crate::EngineBuilder::check_deploy)
    /// instead, which builds no engine (building one registers the new
    /// build's definitions over the live ones); the check itself reads only.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let report = engine.check_deploy().await?;
    /// if !report.is_safe() {
    ///     eprint!("{report}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn check_deploy(&self) -> Result<DeployReport, Error> {
        let inner = &self.inner;
        let mut ids: Vec<String> = inner.functions.keys().cloned().collect();
        ids.sort();
        let mut report = DeployReport::default();
        let mut groups: BTreeMap<(String, u32), DivergenceGroup> = BTreeMap::new();
        let mut unhandled: BTreeMap<(String, u32), UnhandledVersion> = BTreeMap::new();
        let mut after = Uuid::nil();
        loop {
            let page = store::unfinished_runs(&inner.pool, &ids, after, PAGE).await.map_err(from_sqlx)?;
            let Some(last) = page.last() else { break };
            after = last.id;
            let db_now = store::db_now(&inner.pool).await.map_err(from_sqlx)?;
            for run in page {
                report.runs_checked += 1;
                let (id, function_id) = (run.id, run.function_id.clone());
                let version = u32::try_from(run.version).unwrap_or(0);
                match self.dry_replay(run, db_now).await {
                    DryOutcome::Fits => {}
                    DryOutcome::Unhandled => {
                        unhandled
                            .entry((function_id.clone(), version))
                            .and_modify(|u| u.runs += 1)
                            .or_insert(UnhandledVersion { function_id, version, runs: 1, example: id });
                    }
                    DryOutcome::Diverged(d) => {
                        groups.entry((d.function_id.clone(), d.position)).and_modify(|g| g.runs += 1).or_insert_with(
                            || DivergenceGroup {
                                function_id: d.function_id.clone(),
                                position: d.position,
                                runs: 1,
                                example: d,
                            },
                        );
                    }
                    DryOutcome::Problem(problem) => {
                        report.problems.push(ReplayProblem { run_id: id, function_id, problem })
                    }
                }
            }
        }
        report.diverging = groups.into_values().collect();
        report.unhandled = unhandled.into_values().collect();
        tracing::info!(
            checked = report.runs_checked,
            diverging = report.diverging_runs(),
            problems = report.problems.len(),
            unhandled = report.unhandled.len(),
            "deploy check done"
        );
        Ok(report)
    }

    async fn dry_replay(&self, run: store::ReplayRun, db_now: chrono::DateTime<chrono::Utc>) -> DryOutcome {
        if !self.inner.functions.contains_key(&run.function_id) {
            return DryOutcome::Fits;
        }
        let Some(function) = self.inner.handler(&run.function_id, run.version) else {
            return DryOutcome::Unhandled;
        };
        let (signal_tx, signal_rx) = oneshot::channel();
        let journal = Arc::new(Mutex::new(Journal::new(run.journal)));
        let ctx = Ctx::new(CtxParts {
            run_id: run.id,
            function_id: run.function_id.clone(),
            event_id: run.event_id,
            attempt: u32::try_from(run.attempt).unwrap_or(1),
            fence: None,
            stored: run.steps,
            journal: journal.clone(),
            dry: true,
            #[cfg(feature = "testing")]
            probe: None,
            signal: signal_tx,
            lost: CancellationToken::new(),
            writer: Writer::closed(),
            pool: self.inner.pool.clone(),
            limits: self.inner.limits,
            keyring: self.inner.keyring.clone(),
            db_now,
            claimed_at: Instant::now(),
            span: tracing::info_span!("dry_replay", run_id = %run.id, function = %run.function_id),
            step_timeout: function.step_timeout,
        });
        let mut handle = tokio_util::task::AbortOnDropHandle::new(tokio::spawn((function.handler)(ctx, run.payload)));
        let ended = tokio::time::timeout(REPLAY_DEADLINE, async {
            tokio::select! {
                biased;
                signal = signal_rx => match signal {
                    Ok(Signal::Diverged(d)) => DryOutcome::Diverged(d),
                    Ok(Signal::Reached | Signal::Suspended) => DryOutcome::Fits,
                    Ok(Signal::StepFailed(e)) => DryOutcome::Problem(format!("a replayed entry failed: {}", e.message())),
                    Ok(Signal::Fenced | Signal::Cancelled) => DryOutcome::Problem("the replay was stopped".to_owned()),
                    #[cfg(feature = "testing")]
                    Ok(Signal::Crashed) => DryOutcome::Problem("the replay was stopped".to_owned()),
                    Err(_) => match (&mut handle).await {
                        Ok(r) => returned(&journal, &run.function_id, run.id, r.err().map(|e| e.message().to_owned())),
                        Err(e) => DryOutcome::Problem(format!("the handler panicked: {e}")),
                    },
                },
                joined = &mut handle => match joined {
                    Ok(r) => returned(&journal, &run.function_id, run.id, r.err().map(|e| e.message().to_owned())),
                    Err(e) => DryOutcome::Problem(format!("the handler panicked: {e}")),
                },
            }
        })
        .await;
        handle.abort();
        ended.unwrap_or_else(|_| {
            DryOutcome::Problem(format!("the replay did not stop within {} s", REPLAY_DEADLINE.as_secs()))
        })
    }

    /// Queues a `diverged` run again as it is: for a run whose divergence the
    /// new code fixed (for example with [`Ctx::changed`]). Its replay is checked
    /// again; if it still diverges it is parked again.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// engine.resume_diverged(id).await?;
    /// # Ok(()) }
    /// ```
    pub async fn resume_diverged(&self, run_id: Uuid) -> Result<(), Error> {
        self.act_on_diverged(run_id, store::DivergedAction::Resume).await
    }

    /// Forgets a `diverged` run's entries from `position` on (their stored
    /// results, journal entries and open waits) and queues it: the new code
    /// then executes those entries afresh (their step bodies run again). Use
    /// the position of its [`Divergence`] to keep what came before. A child
    /// run started by a discarded invoke is not cancelled; an invoke of the
    /// same step name finds it again.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// if let durastep::inspect::Why::Diverged { divergence: Some(d), .. } = engine.inspect().why(id).await? {
    ///     engine.discard_from(id, d.position).await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn discard_from(&self, run_id: Uuid, position: u32) -> Result<(), Error> {
        self.act_on_diverged(run_id, store::DivergedAction::DiscardFrom(position)).await
    }

    async fn act_on_diverged(&self, run_id: Uuid, action: store::DivergedAction) -> Result<(), Error> {
        match store::act_on_diverged(&self.inner.pool, run_id, action).await {
            Ok(None) => Ok(()),
            Ok(Some(state)) => Err(Error::NotDiverged { run_id, state }),
            Err(sqlx::Error::RowNotFound) => Err(Error::UnknownRun(run_id)),
            Err(e) => Err(from_sqlx(e)),
        }
    }
}

/// The handler returned during a dry replay: it fits unless it left recorded
/// entries unasked.
fn returned(journal: &Mutex<Journal>, function_id: &str, run_id: Uuid, failed: Option<String>) -> DryOutcome {
    match journal.lock().unwrap_or_else(|p| p.into_inner()).unasked() {
        Some((position, recorded)) => DryOutcome::Diverged(Divergence {
            run_id,
            function_id: function_id.to_owned(),
            position,
            recorded: Some(recorded),
            asked: None,
        }),
        None => match failed {
            None => DryOutcome::Fits,
            Some(e) => DryOutcome::Problem(format!("the handler failed on replay: {e}")),
        },
    }
}
