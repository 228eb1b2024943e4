//! The console's publications: a change, a revert or the branch head
//! becomes the record in force. One order for all three: checked, gated
//! (the capture chosen; required with `rules.kafka.require_gate`), then
//! committed (a change failing the gate never reaches the repository),
//! then produced through [`crate::release`], the path of `rules publish`.
//! Each is audited with the version in force before and after and the
//! commit.

use std::sync::Arc;

use axum::{
    Json,
    extract::State,
    http::{HeaderMap, StatusCode},
};
use serde::Deserialize;
use serde_json::json;

use super::{
    Console, Peer,
    audit::AuditEntry,
    auth::{Role, User},
    handlers::{Answer, ApiError, ChangeBody, blocking, commit_id, error, message},
};
use crate::{
    release::{self, GateRun, Prepared, ReleaseError},
    replay::Report,
    rollout::{git, publish},
    rules::encoding::SnapshotRecord,
};

/// One publication: what the audit log calls it and what it published.
struct Publication {
    action: &'static str,
    detail: String,
    candidate: publish::Candidate,
    capture: Option<String>,
    /// Whether the record names the version it replaces as rolled back.
    rollback: bool,
}

/// Who is publishing what, from which version: the audit entries of one publication.
struct Audit<'a> {
    user: &'a User,
    action: &'static str,
    before: Option<String>,
}

impl Audit<'_> {
    fn entry(&self, outcome: &str, detail: String) -> AuditEntry {
        let mut entry = AuditEntry::new(self.user, self.action, outcome, detail);
        entry.before.clone_from(&self.before);
        entry
    }
}

/// Gates `p.candidate`, then makes the commit with `commit` (blocking),
/// then produces the record with the commit as its provenance.
async fn publish_commit(console: &Arc<Console>, user: &User, p: Publication, commit: MakeCommit) -> Answer {
    let capture = console.gate_of(p.capture.as_deref())?;
    let _one =
        console.heavy.acquire().await.map_err(|_| error(StatusCode::SERVICE_UNAVAILABLE, "stopping"))?;
    let mut provenance = publish::provenance(&[]);
    provenance.paths = p.candidate.paths.iter().map(|p| p.display().to_string()).collect();
    provenance.publisher.push_str(" (admin console)");
    let gate = capture.as_deref().map(|capture| GateRun { capture, thresholds: console.config.gate });
    let prepared =
        release::prepare(&console.config, &p.candidate, provenance, gate, console.trust.clone()).await;
    let mut audit = Audit { user, action: p.action, before: None };
    let mut prepared = match prepared {
        Ok(prepared) => prepared,
        Err(e) => {
            // The version in force as the console last saw it: the topic's
            // history was not read, or the gate refused.
            let seen = console.view().await.ok();
            audit.before = seen.as_ref().and_then(|v| v.in_force()).map(|r| r.version.clone());
            let outcome = if matches!(e, ReleaseError::GateFailed(_)) { "refused" } else { "failed" };
            console.log(audit.entry(outcome, format!("{}: {e}", p.detail))).await?;
            return Err(e.into());
        }
    };
    // The version in force, from the history `prepare` has just read.
    audit.before = match &mut prepared {
        Prepared::InForce { version } => Some(version.clone()),
        Prepared::Ready { record, .. } => {
            if p.rollback {
                record.provenance.rolled_back_from.clone_from(&record.previous);
            }
            record.previous.clone()
        }
    };
    // Logged before anything irreversible: an action that cannot be
    // logged is not taken. The outcome follows in its own entry.
    console.log(audit.entry("started", p.detail.clone())).await?;
    let made = match blocking(commit).await {
        Ok(made) => made,
        Err(e) => {
            let why = e.1["error"].as_str().unwrap_or_default();
            console.log(audit.entry("failed", format!("{}: {why}", p.detail))).await?;
            return Err(e);
        }
    };
    match prepared {
        Prepared::InForce { version } => {
            let mut done = audit.entry("ok", format!("{}: already in force", p.detail));
            (done.after, done.commit) = (Some(version.clone()), Some(made.id.clone()));
            console.log(done).await?;
            Ok(Json(json!({ "commit": made.id, "version": version, "already_in_force": true })))
        }
        Prepared::Ready { record, report } => {
            produce(console, &audit, &p.detail, made, *record, report).await
        }
    }
}

/// Produces `record`, made from commit `made`, signed; audited either way.
async fn produce(
    console: &Arc<Console>,
    audit: &Audit<'_>,
    detail: &str,
    made: git::Commit,
    mut record: SnapshotRecord,
    report: Option<Box<Report>>,
) -> Answer {
    record.provenance.git_commit = Some(made.id.clone());
    record.provenance.git_author = Some(made.author.clone());
    record.provenance.git_dirty = Some(false);
    let produced = publish::publish(&console.config.rules.kafka, &record, console.signer.as_ref()).await;
    console.forget_view();
    let mut done = match &produced {
        Ok(_) => audit.entry("ok", detail.to_owned()),
        Err(e) => audit.entry("failed", format!("{detail}: committed {} but not published: {e}", made.id)),
    };
    (done.after, done.commit) = (produced.is_ok().then(|| record.version.clone()), Some(made.id.clone()));
    console.log(done).await?;
    let offset = produced.map_err(|e| {
        error(StatusCode::BAD_GATEWAY, format!("committed {} but not published: {e}", made.id))
    })?;
    Ok(Json(json!({
        "commit": made.id,
        "version": record.version,
        "previous": record.previous,
        "offset": offset,
        "report": report,
    })))
}

/// The commit at the head of the branch; an error when it has none.
fn branch_head(workspace: &super::workspace::Workspace) -> Result<String, ApiError> {
    workspace
        .head()?
        .ok_or_else(|| error(StatusCode::BAD_REQUEST, format!("{} has no commit", workspace.branch)))
}

/// How a publication's commit is made, once it passed the gate (blocking).
type MakeCommit = Box<dyn FnOnce() -> Result<git::Commit, ApiError> + Send>;

/// `staged`, or its error written to the audit log as `action` refused:
/// a publication that never reached the gate is still an action.
async fn staged<T>(
    console: &Arc<Console>,
    user: &User,
    action: &str,
    staged: Result<T, ApiError>,
) -> Result<T, ApiError> {
    match staged {
        Ok(staged) => Ok(staged),
        Err(e) => {
            let why = e.1["error"].as_str().unwrap_or_default().to_owned();
            console.log(AuditEntry::new(user, action, "refused", why)).await?;
            Err(e)
        }
    }
}

/// `POST /api/publish`: the change (on `base`, the branch head the
/// publisher reviewed) committed as the publisher with the reviewer's
/// message, and published. A proposal it came from is closed.
pub(super) async fn publish(
    State(console): State<Arc<Console>>,
    peer: Peer,
    headers: HeaderMap,
    Json(body): Json<ChangeBody>,
) -> Answer {
    let user = console.user(&headers, &peer, Role::Publisher, "publish").await?;
    let stage = stage_publish(&console, &user, body).await;
    let (publication, commit, proposal) = staged(&console, &user, "publish", stage).await?;
    let answer = publish_commit(&console, &user, publication, commit).await?;
    if let Some(p) = proposal {
        let repo = console.workspace.repo.clone();
        // Closed whatever the outcome of the removal: it is only a reference.
        let _ = blocking(move || git::withdraw(&repo, p.id, &p.commit).map_err(|e| error(StatusCode::OK, e)))
            .await;
    }
    Ok(answer)
}

/// The checks of a publish: the message, the head it was reviewed on, the
/// rules; its commit and the proposal it closes.
async fn stage_publish(
    console: &Arc<Console>,
    user: &User,
    body: ChangeBody,
) -> Result<(Publication, MakeCommit, Option<git::Proposal>), ApiError> {
    let mut text = message(body.message.as_deref().unwrap_or_default(), "commit message")?;
    let c = console.clone();
    let wanted = body.proposal;
    let (head, proposal) = blocking(move || {
        let proposal = match wanted {
            Some(id) => git::proposals(&c.workspace.repo)?.into_iter().find(|p| p.id == id),
            None => None,
        };
        Ok((c.workspace.head()?, proposal))
    })
    .await?;
    if head != body.base {
        let (branch, now) = (&console.workspace.branch, head.as_deref().unwrap_or("nothing"));
        let why = format!("{branch} moved since the change was loaded (now {now}): reload and review again");
        return Err(error(StatusCode::CONFLICT, why));
    }
    let checked = console.checked(body.base.clone(), body.files).await?;
    if checked.changes.is_empty() {
        return Err(error(StatusCode::BAD_REQUEST, "nothing to publish: the files are the branch's"));
    }
    if let Some(p) = &proposal {
        text.push_str(&format!("\n\nProposed-by: {}", p.author));
    }
    let detail = text.lines().next().unwrap_or_default().to_owned();
    let (c, author, base) = (console.clone(), Console::author(user), body.base);
    let changes = checked.changes;
    let commit: MakeCommit = Box::new(move || {
        let w = &c.workspace;
        Ok(git::commit(&w.repo, &w.branch, base.as_deref(), &changes, &author, &text)?)
    });
    let publication = Publication {
        action: "publish",
        detail,
        candidate: checked.candidate,
        capture: body.capture,
        rollback: false,
    };
    Ok((publication, commit, proposal))
}

/// A rollback as the page sends it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RollbackBody {
    /// The commit whose change is undone.
    commit: String,
    /// The reviewer's text.
    message: String,
    #[serde(default)]
    capture: Option<String>,
}

/// `POST /api/rollback`: a revert of `commit` on the branch head, checked
/// and gated before it is committed, published like a change.
pub(super) async fn rollback(
    State(console): State<Arc<Console>>,
    peer: Peer,
    headers: HeaderMap,
    Json(body): Json<RollbackBody>,
) -> Answer {
    let user = console.user(&headers, &peer, Role::Publisher, "rollback").await?;
    let stage = stage_rollback(&console, &user, body).await;
    let (publication, commit) = staged(&console, &user, "rollback", stage).await?;
    publish_commit(&console, &user, publication, commit).await
}

/// The checks of a rollback: the message, the commit, the revert's tree
/// and its rules; the revert's commit.
async fn stage_rollback(
    console: &Arc<Console>,
    user: &User,
    body: RollbackBody,
) -> Result<(Publication, MakeCommit), ApiError> {
    let text = message(&body.message, "commit message")?;
    let target = commit_id(&body.commit)?.to_owned();
    let c = console.clone();
    let (head, tree, candidate) = blocking(move || {
        let w = &c.workspace;
        let head = branch_head(w)?;
        let tree = git::reverted(&w.repo, &head, &target)?;
        let files = git::tree_files(&w.repo, &tree, &w.paths())?;
        Ok((head, tree, w.compile(&c.config, &files)?))
    })
    .await?;
    let detail = format!("revert {}: {}", body.commit, text.lines().next().unwrap_or_default());
    let (c, author) = (console.clone(), Console::author(user));
    let commit: MakeCommit = Box::new(move || {
        let w = &c.workspace;
        Ok(git::commit_tree(&w.repo, &w.branch, &head, &tree, &author, &text)?)
    });
    Ok((Publication { action: "rollback", detail, candidate, capture: body.capture, rollback: true }, commit))
}

/// A sync as the page sends it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SyncBody {
    #[serde(default)]
    capture: Option<String>,
}

/// `POST /api/sync`: the branch head published when it is not in force
/// (a change that reached the repository by other means), as `rules sync`.
pub(super) async fn sync(
    State(console): State<Arc<Console>>,
    peer: Peer,
    headers: HeaderMap,
    Json(body): Json<SyncBody>,
) -> Answer {
    let user = console.user(&headers, &peer, Role::Publisher, "sync").await?;
    let c = console.clone();
    let stage = blocking(move || {
        let w = &c.workspace;
        let head = branch_head(w)?;
        let (made, files) = git::files(&w.repo, &head, &w.paths())?;
        Ok((made, w.compile(&c.config, &files)?))
    })
    .await;
    let (made, candidate) = staged(&console, &user, "sync", stage).await?;
    let detail = format!("{} at {}", console.workspace.branch, made.id);
    let publication =
        Publication { action: "sync", detail, candidate, capture: body.capture, rollback: false };
    publish_commit(&console, &user, publication, Box::new(move || Ok(made))).await
}
