//! The six side effects of a stage change, each its own Durastep function.
//!
//! The receiver sends one event per stage change; the engine creates one run
//! per function the event triggers, so one stage change becomes five runs, or
//! six on `placement`. Every run:
//!
//! 1. decides what to do in a step `mode` (live, dry run, or switched off;
//!    see [`crate::settings`]), so the decision is on record;
//! 2. live: builds the request and sends it in a step `send`, with the
//!    stage change's dedupe key as the idempotency token, so a retried step
//!    lands on the same write; dry run: stores the request in a step
//!    `would-send` and sends nothing;
//! 3. returns an [`Outcome`], stored as the run's output.
//!
//! Every function has the story's retry policy: 5 attempts, waiting
//! `30 s * attempts^2` after each failure (30 s, 2 min, 4.5 min, 8 min), then
//! the run is `failed` (the story's `dead`). The draft invoice also shares a
//! concurrency limit of 1 with every function that calls the invoicing system
//! ([`INVOICING`]), and a 429 from it pauses them all until its `Retry-After`
//! ([`INVOICING_PAUSE`]) without costing an attempt.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use durastep::{Backoff, Ctx, Engine, Function, HandlerError, HandlerResult, ReplayFrom, RunFilter, RunState};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::http::{ApiRequest, Client};
use crate::settings::{Mode, Settings};
use crate::stage::{Stage, StageChange};

/// Attempts per run, as in the story: after the 5th failure the run is dead.
pub const ATTEMPTS: u32 = 5;

/// The name of the concurrency limit that every function calling the
/// invoicing system shares: one request at a time, whatever the queue depth.
pub const INVOICING: &str = "exact-online";

/// The name of the back-pressure key those functions share: a 429 from the
/// invoicing system pauses all of them until its `Retry-After`.
pub const INVOICING_PAUSE: &str = "exact-online-429";

/// The story's backoff: `30 s * attempts^2`, `attempts` being the number of
/// the attempt that failed (1 for the first).
///
/// ```
/// let b = placement_pipeline::side_effects::story_backoff();
/// let waits: Vec<u64> = (1..=4).map(|n| b.delay(n).as_secs()).collect();
/// assert_eq!(waits, [30, 120, 270, 480]);
/// ```
pub fn story_backoff() -> Backoff {
    Backoff::custom(|attempt| Duration::from_secs(30 * u64::from(attempt).pow(2)))
}

/// One side effect of a stage change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SideEffect {
    /// 1. Email the candidate a stage-specific mail.
    CandidateMail,
    /// 2. Create a CRM task for the candidate's recruiter.
    RecruiterTask,
    /// 3. Post to the client account's chat channel.
    ChannelPost,
    /// 4. Append a row to the master placement sheet.
    SheetRow,
    /// 5. Update the candidate's outreach status.
    OutreachStatus,
    /// 6. On stage `placement` only: create a draft invoice.
    DraftInvoice,
}

impl SideEffect {
    /// All six, in the story's order.
    pub const ALL: [SideEffect; 6] = [
        SideEffect::CandidateMail,
        SideEffect::RecruiterTask,
        SideEffect::ChannelPost,
        SideEffect::SheetRow,
        SideEffect::OutreachStatus,
        SideEffect::DraftInvoice,
    ];

    /// The Durastep function id (also the switch's name).
    pub fn function_id(self) -> &'static str {
        match self {
            SideEffect::CandidateMail => "send-candidate-mail",
            SideEffect::RecruiterTask => "create-recruiter-task",
            SideEffect::ChannelPost => "post-to-channel",
            SideEffect::SheetRow => "append-placement-row",
            SideEffect::OutreachStatus => "update-outreach-status",
            SideEffect::DraftInvoice => "create-draft-invoice",
        }
    }

    /// The stages whose changes trigger it.
    pub fn stages(self) -> &'static [Stage] {
        match self {
            SideEffect::DraftInvoice => &[Stage::Placement],
            _ => &Stage::ALL,
        }
    }
}

impl fmt::Display for SideEffect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.function_id())
    }
}

/// A name that is not one of the six function ids.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown side effect {0:?} (expected one of send-candidate-mail, create-recruiter-task, post-to-channel, append-placement-row, update-outreach-status, create-draft-invoice)"
)]
pub struct UnknownSideEffect(pub String);

impl FromStr for SideEffect {
    type Err = UnknownSideEffect;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SideEffect::ALL.into_iter().find(|e| e.function_id() == s).ok_or_else(|| UnknownSideEffect(s.to_owned()))
    }
}

/// The base URLs of the six external systems (simulators or the real APIs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    /// The mail API.
    pub mail: String,
    /// The CRM's task API.
    pub crm: String,
    /// The chat API.
    pub chat: String,
    /// The sheets API.
    pub sheet: String,
    /// The outreach tool's API.
    pub outreach: String,
    /// The invoicing API.
    pub invoicing: String,
}

/// What the side effect functions need: where the systems are, how to reach
/// them, and the switches and channel configuration.
#[derive(Clone, Debug)]
pub struct Pipeline {
    /// The external systems' base URLs.
    pub endpoints: Endpoints,
    /// The HTTP client.
    pub client: Client,
    /// The switches and channel configuration.
    pub settings: Settings,
}

/// What a run did; stored as its output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The side effect was fired.
    Sent {
        /// The idempotency token it was sent with.
        idempotency_key: String,
        /// What the system answered (its id for the new object, if any).
        answer: Value,
    },
    /// Dry run: nothing was sent; this is what would have been.
    DryRun {
        /// The request that live mode would have sent.
        would_send: ApiRequest,
    },
    /// The side effect's switch was off when the run executed.
    SwitchedOff,
}

/// The six functions.
pub fn functions(pipeline: &Pipeline) -> Vec<Function> {
    SideEffect::ALL.into_iter().map(|e| function(e, pipeline.clone())).collect()
}

/// The function for one side effect.
pub fn function(side_effect: SideEffect, pipeline: Pipeline) -> Function {
    let mut f = Function::new(side_effect.function_id());
    for stage in side_effect.stages() {
        f = f.on_event(stage.event_name());
    }
    f = f.retries(ATTEMPTS - 1).backoff(story_backoff());
    if side_effect == SideEffect::DraftInvoice {
        f = f
            .concurrency(durastep::Concurrency::new(1).shared(INVOICING))
            .backpressure(durastep::Backpressure::new().shared(INVOICING_PAUSE));
    }
    f.handler(move |ctx: Ctx, change: StageChange| {
        let pipeline = pipeline.clone();
        async move { perform(&ctx, side_effect, &change, &pipeline).await }
    })
}

/// Re-runs the dead runs of one side effect (state `failed`: out of attempts,
/// or failed permanently): the story's "fixed and re-run". Each resumes at the
/// step that failed ([`ReplayFrom::FailedStep`]): its `mode` decision is kept,
/// and `send` builds its request again, so a corrected configuration (a
/// channel name) is what goes out. Returns the runs queued again; a worker
/// picks them up at once.
pub async fn rerun_dead(engine: &Engine, side_effect: SideEffect) -> Result<Vec<Uuid>, durastep::Error> {
    let dead = RunFilter::new().function(side_effect.function_id()).state(RunState::Failed);
    engine.replay_many(&dead, ReplayFrom::FailedStep).await
}

async fn perform(ctx: &Ctx, side_effect: SideEffect, change: &StageChange, p: &Pipeline) -> HandlerResult<Outcome> {
    let mode: Mode = ctx
        .step("mode", || async {
            p.settings.mode(side_effect).await.map_err(|e| HandlerError::new(format!("reading the switches: {e}")))
        })
        .await?;
    match mode {
        Mode::Off => Ok(Outcome::SwitchedOff),
        Mode::DryRun => {
            let would_send = ctx.step("would-send", || request(side_effect, change, p)).await?;
            Ok(Outcome::DryRun { would_send })
        }
        Mode::Live => {
            ctx.step("send", || async {
                // Built inside the step, so a retry after a configuration fix
                // (a corrected channel name) sends the corrected request.
                let request = request(side_effect, change, p).await?;
                let answer = p.client.send(&request).await?;
                check_answer(side_effect, &request, &answer)?;
                Ok(Outcome::Sent { idempotency_key: request.idempotency_key, answer })
            })
            .await
        }
    }
}

/// The request one side effect sends for one stage change.
async fn request(side_effect: SideEffect, change: &StageChange, p: &Pipeline) -> HandlerResult<ApiRequest> {
    // Each system receives one kind of side effect, so the bare dedupe key is
    // a distinct token everywhere; a system receiving two would need
    // `{key}:{side effect}`.
    let key = change.dedupe_key();
    let e = &p.endpoints;
    let post = |url: String, body: Value| ApiRequest { method: "POST".into(), url, idempotency_key: key.clone(), body };
    Ok(match side_effect {
        SideEffect::CandidateMail => post(
            format!("{}/v1/messages", e.mail),
            json!({
                "to": change.candidate_email,
                "subject": mail_subject(change.stage),
                "text": format!("Hi {}, {}", change.candidate_name, mail_subject(change.stage).to_lowercase()),
            }),
        ),
        SideEffect::RecruiterTask => post(
            format!("{}/crm/v3/objects/tasks", e.crm),
            json!({
                "owner_id": change.recruiter_id,
                "contact_id": change.contact_id,
                "subject": format!("Follow up with {} ({})", change.candidate_name, change.stage),
            }),
        ),
        SideEffect::ChannelPost => {
            let channel = p
                .settings
                .channel(&change.client_account)
                .await
                .map_err(|e| HandlerError::new(format!("reading the channel configuration: {e}")))?
                .ok_or_else(|| {
                    HandlerError::new(format!(
                        "no chat channel configured for client account {}",
                        change.client_account
                    ))
                })?;
            post(
                format!("{}/api/chat.postMessage", e.chat),
                json!({
                    "channel": channel,
                    "text": format!("{} moved to {}", change.candidate_name, change.stage),
                }),
            )
        }
        SideEffect::SheetRow => post(
            format!("{}/v4/spreadsheets/placements/values/append", e.sheet),
            json!({"values": [[
                key,
                change.occurred_at.to_rfc3339(),
                change.contact_id,
                change.candidate_name,
                change.stage,
                change.client_account,
                change.fee_cents,
            ]]}),
        ),
        SideEffect::OutreachStatus => ApiRequest {
            method: "PUT".into(),
            url: format!("{}/v1/prospects/{}/status", e.outreach, change.candidate_email),
            idempotency_key: key.clone(),
            body: json!({"status": outreach_status(change.stage)}),
        },
        SideEffect::DraftInvoice => {
            let fee = change
                .fee_cents
                .ok_or_else(|| HandlerError::permanent(format!("placement {key} has no fee to invoice")))?;
            post(
                format!("{}/api/v1/1/salesinvoice/SalesInvoices", e.invoicing),
                json!({
                    "OrderedBy": change.client_account,
                    "Description": format!("Placement fee: {}", change.candidate_name),
                    "AmountCents": fee,
                    "YourRef": key,
                }),
            )
        }
    })
}

/// Errors a system reports in a successful HTTP answer.
fn check_answer(side_effect: SideEffect, request: &ApiRequest, answer: &Value) -> HandlerResult<()> {
    if side_effect == SideEffect::ChannelPost && answer.get("ok") != Some(&Value::Bool(true)) {
        // Retried like any failure: the story's typo failed 5 times, then the
        // run was dead until the channel name was fixed and the run re-run.
        let channel = request.body.get("channel").and_then(Value::as_str).unwrap_or("?");
        let error = answer.get("error").and_then(Value::as_str).unwrap_or("unknown error");
        return Err(HandlerError::new(format!("chat refused the post to {channel}: {error}")));
    }
    Ok(())
}

fn mail_subject(stage: Stage) -> &'static str {
    match stage {
        Stage::Sourced => "We would like to introduce you to a role",
        Stage::IntroCall => "Thanks for the intro call",
        Stage::ClientInterview => "Your client interview is confirmed",
        Stage::Offer => "You have an offer",
        Stage::Placement => "Congratulations on your new role",
        Stage::Invoice => "Your placement is confirmed with the client",
        Stage::Renewal => "Your contract has been renewed",
    }
}

fn outreach_status(stage: Stage) -> &'static str {
    match stage {
        Stage::Sourced | Stage::IntroCall => "in_conversation",
        Stage::ClientInterview | Stage::Offer => "in_process",
        Stage::Placement | Stage::Invoice | Stage::Renewal => "placed",
    }
}
