//! The command line (clap): every command and flag, with their help.
//! Unknown flags and commands are errors, and a flag that takes a value never
//! takes the next flag as that value.

use clap::{Args, Parser, Subcommand};

/// Story B: a media-buying agency's budget writes to Meta, TikTok and
/// LinkedIn as durable step functions, against local simulators.
#[derive(Debug, Parser)]
#[command(name = "media-buying", max_term_width = 100)]
pub struct Cli {
    /// What to do (default: `demo`).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The story end to end on a fresh database, against the simulators
    /// (uses DATABASE_URL, else a local Postgres, else a throwaway cluster).
    Demo,
    /// One worker process against the given platforms, until Ctrl-C.
    Worker(WorkerArgs),
    /// The founder's view (default: the demo's database).
    Founder(FounderArgs),
    /// The shadow week on TikTok against the simulators, ending with the comparison report.
    ShadowWeek,
    /// The comparison report of a platform's shadow mode (default: the shadow week's database).
    ShadowReport(ShadowReportArgs),
    /// Import the finance sheet (a CSV export) against the budget writes; a
    /// worker imports it row by row and flags rows that do not match for review.
    ImportFinance(ImportFinanceArgs),
    /// An accountant's decision on a flagged finance row (see the founder's view).
    Review(ReviewArgs),
    /// Replay the unfinished runs against this build, writing nothing; exit 0:
    /// none diverges, 1: some do, 2: error (for CI, before a deploy).
    CheckDeploy(CheckDeployArgs),
}

/// `media-buying check-deploy`
#[derive(Debug, Args)]
pub struct CheckDeployArgs {
    /// The database of Durastep and the state store (default: the demo's,
    /// `durastep_media_buying` on DATABASE_URL's server). A role with the
    /// reader grants of docs/security.md and SELECT on media.finance_imports
    /// is enough (the README's "Checking a deploy").
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
    /// Check with Meta in shadow mode, as the workers run it.
    #[arg(long)]
    pub meta_shadow: bool,
    /// Check with TikTok in shadow mode, as the workers run it.
    #[arg(long)]
    pub tiktok_shadow: bool,
}

/// The database a command reads, when not the default.
#[derive(Debug, Args)]
pub struct DatabaseArg {
    /// The database of Durastep and the state store (default: the demo's,
    /// `durastep_media_buying` on DATABASE_URL's server).
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

/// `media-buying shadow-report`
#[derive(Debug, Args)]
pub struct ShadowReportArgs {
    /// The platform in shadow mode.
    #[arg(long, value_enum, default_value = "tiktok")]
    pub platform: PlatformArg,
    /// The database (default: the shadow week's, `durastep_media_buying_shadow` on DATABASE_URL's server).
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

/// A platform on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlatformArg {
    /// Meta.
    Meta,
    /// TikTok.
    Tiktok,
    /// LinkedIn.
    Linkedin,
}

impl From<PlatformArg> for crate::Platform {
    fn from(p: PlatformArg) -> crate::Platform {
        match p {
            PlatformArg::Meta => crate::Platform::Meta,
            PlatformArg::Tiktok => crate::Platform::TikTok,
            PlatformArg::Linkedin => crate::Platform::LinkedIn,
        }
    }
}

/// `media-buying import-finance`
#[derive(Debug, Args)]
pub struct ImportFinanceArgs {
    /// The CSV export of the finance sheet (columns date, client, platform,
    /// account, campaign, daily_budget, reference).
    pub file: std::path::PathBuf,
    /// The database.
    #[command(flatten)]
    pub database: DatabaseArg,
}

/// `media-buying review`
#[derive(Debug, Args)]
pub struct ReviewArgs {
    /// The flagged row's id (the first column of the founder's review queue).
    pub row: i64,
    /// approve, or correct with --amount.
    #[arg(value_enum)]
    pub action: ReviewAction,
    /// The corrected daily budget in euros (with `correct`), e.g. 25.00.
    #[arg(long, value_name = "EUROS", required_if_eq("action", "correct"))]
    pub amount: Option<String>,
    /// Who decides.
    #[arg(long)]
    pub by: String,
    /// Why, in a few words.
    #[arg(long)]
    pub note: Option<String>,
    /// The database.
    #[command(flatten)]
    pub database: DatabaseArg,
}

/// What an accountant does with a flagged row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReviewAction {
    /// The row is right as it is.
    Approve,
    /// The row's daily budget is corrected to --amount.
    Correct,
}

/// `media-buying worker`
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The database of Durastep and the state store.
    #[arg(long, value_name = "URL")]
    pub database_url: String,
    /// Meta Graph API base URL.
    #[arg(long, value_name = "URL")]
    pub meta: String,
    /// TikTok Business API base URL.
    #[arg(long, value_name = "URL")]
    pub tiktok: String,
    /// LinkedIn Marketing API base URL.
    #[arg(long, value_name = "URL")]
    pub linkedin: String,
    /// The chat workspace of the on-call channel.
    #[arg(long, value_name = "URL")]
    pub chat: String,
    /// Shadow mode for Meta: run beside the old writer, write nothing to Meta, compare.
    #[arg(long)]
    pub meta_shadow: bool,
    /// Shadow mode for TikTok: run beside the old writer, write nothing to TikTok, compare.
    #[arg(long)]
    pub tiktok_shadow: bool,
}

/// `media-buying founder`
#[derive(Debug, Args)]
pub struct FounderArgs {
    /// The database.
    #[command(flatten)]
    pub database: DatabaseArg,
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORKER: [&str; 11] = [
        "media-buying",
        "worker",
        "--database-url",
        "postgres://x/y",
        "--meta",
        "http://m",
        "--tiktok",
        "http://t",
        "--linkedin",
        "http://l",
        "--chat",
    ];

    fn worker(extra: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(WORKER.iter().copied().chain(["http://c"]).chain(extra.iter().copied()))
    }

    /// Catches: a typo in `--meta-shadow` silently leaving shadow mode off.
    #[test]
    fn an_unknown_flag_is_an_error() {
        let e = worker(&["--meta-shadw"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
        assert!(e.to_string().contains("--meta-shadw"), "{e}");
        let Some(Command::Worker(w)) = worker(&["--meta-shadow"]).unwrap().command else { panic!() };
        assert!(w.meta_shadow && !w.tiktok_shadow);
    }

    /// Catches: `--meta --tiktok x` taking `--tiktok` as Meta's URL.
    #[test]
    fn a_flag_is_never_taken_as_a_value() {
        let e = Cli::try_parse_from([
            "media-buying",
            "worker",
            "--database-url",
            "postgres://x/y",
            "--meta",
            "--tiktok",
            "http://t",
            "--linkedin",
            "http://l",
            "--chat",
            "http://c",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("--meta"), "{e}");
    }

    #[test]
    fn a_correction_needs_an_amount() {
        assert!(Cli::try_parse_from(["media-buying", "review", "7", "correct", "--by", "ann"]).is_err());
        assert!(
            Cli::try_parse_from(["media-buying", "review", "7", "correct", "--amount", "25,00", "--by", "ann"]).is_ok()
        );
        assert!(Cli::try_parse_from(["media-buying", "review", "7", "approve", "--by", "ann"]).is_ok());
        assert!(Cli::try_parse_from(["media-buying", "review", "7", "aprove", "--by", "ann"]).is_err());
    }

    #[test]
    fn no_command_is_the_demo_and_unknown_commands_fail() {
        assert!(Cli::try_parse_from(["media-buying"]).unwrap().command.is_none());
        assert!(Cli::try_parse_from(["media-buying", "demo", "--fast"]).is_err());
        assert!(Cli::try_parse_from(["media-buying", "deom"]).is_err());
    }
}
