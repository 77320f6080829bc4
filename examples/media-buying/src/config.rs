//! Where the platforms are, and how the functions behave.

use std::time::Duration;

/// The base URL of every external system. The demo and the tests point them at
/// the simulators; a user points them at the real APIs.
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// Meta Graph API, e.g. `https://graph.facebook.com`.
    pub meta: String,
    /// TikTok Business API, e.g. `https://business-api.tiktok.com`.
    pub tiktok: String,
    /// LinkedIn Marketing API, e.g. `https://api.linkedin.com`.
    pub linkedin: String,
    /// The chat workspace of the on-call channel, e.g. `https://slack.com`.
    pub chat: String,
}

/// A deliberate process crash, for the end-to-end crash tests only (read from
/// `MEDIA_BUYING_CRASH` by the `worker` command).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// Inside Meta's `push` step, right after Meta accepted the write and
    /// before the step's checkpoint: the next attempt pushes again, with the
    /// same idempotency key (`meta-push-sent`).
    MetaPushSent,
    /// Between Meta's `push` (checkpointed) and `log` steps (`meta-before-log`).
    MetaBeforeLog,
    /// In the finance import, right after row N's checkpoint (`finance-after-row-N`).
    FinanceAfterRow(u32),
}

impl CrashPoint {
    /// Parses the value of `MEDIA_BUYING_CRASH`.
    pub fn parse(s: &str) -> Option<CrashPoint> {
        match s {
            "meta-push-sent" => Some(CrashPoint::MetaPushSent),
            "meta-before-log" => Some(CrashPoint::MetaBeforeLog),
            _ => s.strip_prefix("finance-after-row-").and_then(|n| n.parse().ok()).map(CrashPoint::FinanceAfterRow),
        }
    }
}

/// How the functions are set up.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the platforms are.
    pub endpoints: Endpoints,
    /// Where failures and the Saturday summary go.
    pub on_call_channel: String,
    /// Shadow mode for Meta: the new function runs beside the old writer and
    /// records whether they agree, writing nothing to Meta.
    pub meta_shadow: bool,
    /// Shadow mode for TikTok: the shadow function runs beside the old writer
    /// and records what its write would have been (amount and time) against
    /// the old writer's, writing nothing to TikTok (the story's shadow week).
    pub tiktok_shadow: bool,
    /// In shadow mode, how long to wait (durably) for the old writer before reading Meta back.
    pub shadow_settle: Duration,
    /// A deliberate crash, for the crash tests.
    pub crash_at: Option<CrashPoint>,
    /// How long a flagged finance row waits for an accountant before it expires.
    pub review_period: Duration,
}

impl Settings {
    /// Live mode on every channel, on-call channel `#media-on-call`.
    pub fn new(endpoints: Endpoints) -> Settings {
        Settings {
            endpoints,
            on_call_channel: "#media-on-call".to_owned(),
            meta_shadow: false,
            tiktok_shadow: false,
            shadow_settle: Duration::from_secs(120),
            crash_at: None,
            review_period: crate::functions::finance::REVIEW_PERIOD,
        }
    }
}
