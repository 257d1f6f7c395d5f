//! Resolving `--model` to a local directory.
//!
//! [`resolve_model`] accepts either an existing path (directory or file, returned as
//! is) or a Hugging Face repo id, `owner/name` or `owner/name@revision`. A repo id is
//! looked up in the standard Hugging Face cache (shared with Python's
//! `huggingface_hub`) and, if it is not complete there, downloaded into it with a
//! progress bar: `config.json`, `tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json` and `chat_template.jinja` when the repo has them, and
//! `model.safetensors` or `model.safetensors.index.json` plus every shard it names.
//!
//! Environment, as in `huggingface_hub`:
//! - `HF_HUB_CACHE` (or legacy `HUGGINGFACE_HUB_CACHE`): the cache directory; default
//!   `$HF_HOME/hub`, with `HF_HOME` defaulting to `$XDG_CACHE_HOME/huggingface`, then
//!   `~/.cache/huggingface`;
//! - `HF_HUB_OFFLINE=1`: never touch the network, use the cache only;
//! - `HF_ENDPOINT`: a mirror instead of `https://huggingface.co`;
//! - `HF_TOKEN` (or `$HF_HOME/token`, or `HF_TOKEN_PATH`): for private / gated repos;
//! - `HF_HUB_DISABLE_PROGRESS_BARS=1`: no progress bars.
//!
//! A snapshot already complete in the cache is used without any network request; to
//! pick up a newer upstream commit, pin `@revision` or clear the cache entry.
//! Every failure is an error with a message saying what to do, never a panic.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};

/// Files every model directory needs.
const REQUIRED: [&str; 3] = ["config.json", "tokenizer.json", "tokenizer_config.json"];
/// Files fetched when the repo has them.
const OPTIONAL: [&str; 2] = ["generation_config.json", "chat_template.jinja"];
const SINGLE_WEIGHTS: &str = "model.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Turns a `--model` argument into a local path: an existing file or directory as is,
/// otherwise a Hugging Face repo id (`owner/name[@revision]`) resolved through the
/// Hugging Face cache, downloading what is missing (see the module docs).
pub fn resolve_model(spec: &str) -> anyhow::Result<PathBuf> {
    let path = Path::new(spec);
    if !spec.is_empty() && path.exists() {
        return Ok(path.to_path_buf());
    }
    let Some(repo) = RepoSpec::parse(spec) else {
        bail!("model path does not exist: {spec}");
    };
    let env = HubEnv::from_env()?;
    resolve_repo(&repo, &env).map_err(|e| {
        // `models/typo` when ./models exists was most likely meant as a local path.
        let owner = repo.repo_id.split('/').next().unwrap_or_default();
        if Path::new(owner).is_dir() {
            e.context(format!("model path does not exist: {spec}"))
        } else {
            e
        }
    })
}

/// A Hugging Face model repo id with its revision (`main` unless `@revision` is given).
#[derive(Debug, Clone, PartialEq, Eq)]
struct RepoSpec {
    repo_id: String,
    revision: String,
    /// Whether the revision was spelled out (only changes how the spec is printed).
    explicit_revision: bool,
}

impl fmt::Display for RepoSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.explicit_revision {
            write!(f, "{}@{}", self.repo_id, self.revision)
        } else {
            f.write_str(&self.repo_id)
        }
    }
}

impl RepoSpec {
    /// Parses `owner/name` or `owner/name@revision`; `None` if `spec` is not shaped
    /// like a Hub repo id (Hub rules: each part 1–96 of `[A-Za-z0-9._-]`, not starting
    /// or ending with `-` or `.`, no `--` or `..`).
    fn parse(spec: &str) -> Option<Self> {
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id, Some(rev)),
            None => (spec, None),
        };
        let (owner, name) = id.split_once('/')?;
        if !valid_id_part(owner) || !valid_id_part(name) {
            return None;
        }
        if let Some(rev) = revision {
            if !valid_revision(rev) {
                return None;
            }
        }
        Some(Self {
            repo_id: id.to_string(),
            revision: revision.unwrap_or("main").to_string(),
            explicit_revision: revision.is_some(),
        })
    }

    /// The revision names a commit rather than a branch or tag.
    fn is_commit(&self) -> bool {
        self.revision.len() == 40 && self.revision.bytes().all(|b| b.is_ascii_hexdigit())
    }

    /// `models--owner--name`, as in the Hugging Face cache.
    fn cache_folder(&self) -> String {
        format!("models--{}", self.repo_id.replace('/', "--"))
    }
}

fn valid_id_part(s: &str) -> bool {
    (1..=96).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
        && !s.contains("--")
        && !s.contains("..")
}

fn valid_revision(s: &str) -> bool {
    (1..=255).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'))
        && !s.starts_with('/')
        && !s.ends_with('/')
        && !s.split('/').any(|c| c.is_empty() || c == "." || c == "..")
}

/// Where the cache is and how to reach the Hub, read once from the environment.
#[derive(Debug, Clone)]
struct HubEnv {
    cache_dir: PathBuf,
    offline: bool,
    endpoint: String,
    token: Option<String>,
    progress: bool,
}

fn env_nonempty(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

fn env_true(key: &str) -> bool {
    env_nonempty(key).is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

impl HubEnv {
    fn from_env() -> anyhow::Result<Self> {
        let home = || env_nonempty("HOME").or_else(|| env_nonempty("USERPROFILE"));
        let hf_home: Option<PathBuf> = env_nonempty("HF_HOME").map(PathBuf::from).or_else(|| {
            env_nonempty("XDG_CACHE_HOME")
                .map(|x| Path::new(&x).join("huggingface"))
                .or_else(|| home().map(|h| Path::new(&h).join(".cache").join("huggingface")))
        });
        let cache_dir = env_nonempty("HF_HUB_CACHE")
            .or_else(|| env_nonempty("HUGGINGFACE_HUB_CACHE"))
            .map(PathBuf::from)
            .or_else(|| hf_home.as_ref().map(|h| h.join("hub")))
            .context(
                "cannot locate the Hugging Face cache: set HF_HOME or HF_HUB_CACHE, \
                 or pass a local directory with --model",
            )?;
        let token = env_nonempty("HF_TOKEN").or_else(|| env_nonempty("HUGGING_FACE_HUB_TOKEN")).or_else(|| {
            let path = env_nonempty("HF_TOKEN_PATH")
                .map(PathBuf::from)
                .or_else(|| hf_home.as_ref().map(|h| h.join("token")))?;
            let t = std::fs::read_to_string(path).ok()?;
            let t = t.trim();
            (!t.is_empty()).then(|| t.to_string())
        });
        let endpoint = env_nonempty("HF_ENDPOINT")
            .map(|e| e.trim().trim_end_matches('/').to_string())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Ok(Self {
            cache_dir,
            offline: env_true("HF_HUB_OFFLINE"),
            endpoint,
            token,
            progress: !env_true("HF_HUB_DISABLE_PROGRESS_BARS"),
        })
    }
}

/// Cache first; then, unless offline, the Hub.
fn resolve_repo(repo: &RepoSpec, env: &HubEnv) -> anyhow::Result<PathBuf> {
    let cached = cached_snapshot(repo, &env.cache_dir);
    if let Some(dir) = &cached {
        if missing_files(dir).is_empty() {
            return Ok(dir.clone());
        }
    }
    if env.offline {
        let what = match &cached {
            Some(dir) => format!(
                "its cached snapshot {} is incomplete (missing: {})",
                dir.display(),
                missing_files(dir).join(", ")
            ),
            None => format!("it is not in the cache at {}", env.cache_dir.display()),
        };
        bail!(
            "HF_HUB_OFFLINE is set and {repo} cannot be used from the Hugging Face cache: \
             {what}; unset HF_HUB_OFFLINE to download it, or pass a local directory with --model"
        );
    }
    download(repo, env).map_err(|reason| {
        anyhow::anyhow!(
            "could not download {repo} from the Hugging Face Hub ({reason:#}); \
             pass a local directory with --model, or check network access{}",
            if env.endpoint != DEFAULT_ENDPOINT { format!(" (HF_ENDPOINT={})", env.endpoint) } else { String::new() }
        )
    })
}

/// The snapshot directory the cache has for `repo`'s revision, if any.
fn cached_snapshot(repo: &RepoSpec, cache_dir: &Path) -> Option<PathBuf> {
    let repo_dir = cache_dir.join(repo.cache_folder());
    let commit = if repo.is_commit() {
        repo.revision.clone()
    } else {
        let r = std::fs::read_to_string(repo_dir.join("refs").join(&repo.revision)).ok()?;
        let r = r.trim().to_string();
        if r.is_empty() || r.contains(['/', '\\']) || r.starts_with('.') {
            return None;
        }
        r
    };
    let dir = repo_dir.join("snapshots").join(commit);
    dir.is_dir().then_some(dir)
}

/// What `dir` lacks to be a usable model directory (empty when complete).
fn missing_files(dir: &Path) -> Vec<String> {
    let mut missing: Vec<String> = REQUIRED.iter().filter(|f| !dir.join(f).is_file()).map(|f| f.to_string()).collect();
    let index = dir.join(WEIGHTS_INDEX);
    if index.is_file() {
        match std::fs::read(&index).map_err(anyhow::Error::from).and_then(|b| shard_names(&b)) {
            Ok(shards) => missing.extend(shards.into_iter().filter(|s| !dir.join(s).is_file())),
            Err(_) => missing.push(format!("{WEIGHTS_INDEX} (unreadable)")),
        }
    } else if !dir.join(SINGLE_WEIGHTS).is_file() {
        missing.push(format!("{SINGLE_WEIGHTS} (or {WEIGHTS_INDEX})"));
    }
    missing
}

/// The shard files named by a `model.safetensors.index.json`'s `weight_map`, each a
/// plain relative path inside the repo.
fn shard_names(index_json: &[u8]) -> anyhow::Result<BTreeSet<String>> {
    let v: serde_json::Value =
        serde_json::from_slice(index_json).with_context(|| format!("{WEIGHTS_INDEX} is not JSON"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{WEIGHTS_INDEX} has no \"weight_map\" object"))?;
    let mut shards = BTreeSet::new();
    for file in map.values() {
        let file = file.as_str().with_context(|| format!("{WEIGHTS_INDEX}: a weight_map value is not a string"))?;
        if !valid_repo_file(file) {
            bail!("{WEIGHTS_INDEX} names an unsafe shard path: {file:?}");
        }
        shards.insert(file.to_string());
    }
    if shards.is_empty() {
        bail!("{WEIGHTS_INDEX} has an empty weight_map");
    }
    Ok(shards)
}

/// A relative, normal path (no `..`, no absolute path, no backslash, no drive).
fn valid_repo_file(f: &str) -> bool {
    !f.is_empty()
        && !f.starts_with('/')
        && !f.contains(['\\', ':', '\0'])
        && f.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

/// An indicatif (0.18) bar fed by hf-hub's download callbacks.
struct Bar {
    bar: indicatif::ProgressBar,
    label: String,
}

impl Bar {
    fn new(label: String, visible: bool) -> Self {
        let bar = if visible { indicatif::ProgressBar::new(0) } else { indicatif::ProgressBar::hidden() };
        let style = indicatif::ProgressStyle::with_template(
            "{msg} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        bar.set_style(style);
        Self { bar, label }
    }
}

impl Progress for Bar {
    fn init(&mut self, size: usize, _filename: &str) {
        // hf-hub calls init again before resuming: restart from 0, it then reports
        // the bytes already on disk through `update`.
        self.bar.set_length(size as u64);
        self.bar.set_position(0);
        self.bar.set_message(self.label.clone());
    }
    fn update(&mut self, size: usize) {
        self.bar.inc(size as u64);
    }
    fn finish(&mut self) {
        self.bar.finish();
    }
}

/// Turns hf-hub's error into a short reason with a hint.
fn describe(err: ApiError, file: &str) -> anyhow::Error {
    match err {
        ApiError::RequestError(e) => {
            let text = e.to_string();
            match (*e).into_response().map(|r| r.status()) {
                Some(401) | Some(403) => anyhow::anyhow!(
                    "{file}: access denied (HTTP 401/403); the repo may be private or gated: \
                     accept its terms on the Hub and set HF_TOKEN"
                ),
                Some(404) => {
                    anyhow::anyhow!("{file}: not found (HTTP 404): check the repo id and revision")
                }
                Some(code) => anyhow::anyhow!("{file}: HTTP {code}"),
                None => anyhow::anyhow!("{file}: {text}"),
            }
        }
        other => anyhow::anyhow!("{file}: {other}"),
    }
}

/// Runs an hf-hub call, turning an unexpected panic inside it into an error.
fn guarded<T>(file: &str, f: impl FnOnce() -> Result<T, ApiError>) -> anyhow::Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| describe(e, file)),
        Err(_) => bail!("{file}: internal error in the hf-hub client"),
    }
}

/// Downloads what the cache lacks for `repo` and returns the snapshot directory.
fn download(repo: &RepoSpec, env: &HubEnv) -> anyhow::Result<PathBuf> {
    let api = ApiBuilder::from_cache(Cache::new(env.cache_dir.clone()))
        .with_endpoint(env.endpoint.clone())
        .with_token(env.token.clone())
        .with_progress(false)
        .with_retries(3)
        .build()
        .map_err(|e| describe(e, "client setup"))?;
    let hub_repo = Repo::with_revision(repo.repo_id.clone(), RepoType::Model, repo.revision.clone());
    let api_repo = api.repo(hub_repo);
    let info = guarded("repo info", || api_repo.info())?;
    let listed: BTreeSet<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    if info.sha.is_empty() || !info.sha.bytes().all(|b| b.is_ascii_alphanumeric()) {
        bail!("the Hub returned an unexpected commit id {:?}", info.sha);
    }

    for f in REQUIRED {
        if !listed.contains(f) {
            bail!("the repo has no {f}; is it a Spark-X2.5 model repo?");
        }
    }
    let mut files: Vec<String> = REQUIRED.iter().map(|f| f.to_string()).collect();
    files.extend(OPTIONAL.iter().filter(|f| listed.contains(**f)).map(|f| f.to_string()));
    let sharded = listed.contains(WEIGHTS_INDEX);
    if sharded {
        files.push(WEIGHTS_INDEX.to_string());
    } else if listed.contains(SINGLE_WEIGHTS) {
        files.push(SINGLE_WEIGHTS.to_string());
    } else {
        bail!("the repo has neither {SINGLE_WEIGHTS} nor {WEIGHTS_INDEX}");
    }

    let snapshot = env.cache_dir.join(repo.cache_folder()).join("snapshots").join(&info.sha);
    let announced = std::cell::Cell::new(false);
    let fetch = |file: &str, n: usize, total: usize| -> anyhow::Result<()> {
        if snapshot.join(file).is_file() {
            return Ok(());
        }
        if env.progress && !announced.replace(true) {
            eprintln!("fetching {repo} (commit {}) from {} into {}", &info.sha, env.endpoint, env.cache_dir.display());
        }
        let bar = Bar::new(format!("[{n}/{total}] {file}"), env.progress);
        let got = guarded(file, || api_repo.download_with_progress(file, bar))?;
        // The file lands in the snapshot of the commit the Hub served it from;
        // normally `info.sha`, unless the branch moved in between.
        if !snapshot.join(file).is_file() {
            bail!(
                "{file} arrived at {} instead of under {} (did the revision change during \
                 the download? try again)",
                got.display(),
                snapshot.display()
            );
        }
        Ok(())
    };
    let mut total = files.len();
    for (i, f) in files.iter().enumerate() {
        fetch(f, i + 1, total)?;
    }
    if sharded {
        let index = std::fs::read(snapshot.join(WEIGHTS_INDEX))
            .with_context(|| format!("reading the downloaded {WEIGHTS_INDEX}"))?;
        let shards = shard_names(&index)?;
        let done = total;
        total += shards.len();
        for (i, s) in shards.iter().enumerate() {
            if !listed.contains(s.as_str()) {
                bail!("{WEIGHTS_INDEX} names {s}, which the repo does not have");
            }
            fetch(s, done + i + 1, total)?;
        }
    }

    // Point the revision at this snapshot (hf-hub does it per downloaded file; do it
    // also when everything was already cached under that commit).
    if !repo.is_commit() {
        let ref_path = env.cache_dir.join(repo.cache_folder()).join("refs").join(&repo.revision);
        if let Some(parent) = ref_path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&ref_path, &info.sha).with_context(|| format!("writing {}", ref_path.display()))?;
    }
    let missing = missing_files(&snapshot);
    if !missing.is_empty() {
        bail!("download incomplete, {} lacks: {}", snapshot.display(), missing.join(", "));
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> Option<(String, String)> {
        RepoSpec::parse(s).map(|r| (r.repo_id, r.revision))
    }

    fn env_for(cache: &Path, offline: bool, endpoint: &str) -> HubEnv {
        HubEnv { cache_dir: cache.to_path_buf(), offline, endpoint: endpoint.to_string(), token: None, progress: false }
    }

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

    /// A fake cache entry for `o/n` at commit SHA with a two-shard index.
    fn fake_cache(cache: &Path, with_ref: bool) -> PathBuf {
        let repo_dir = cache.join("models--o--n");
        let snap = repo_dir.join("snapshots").join(SHA);
        std::fs::create_dir_all(&snap).unwrap();
        if with_ref {
            std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
            std::fs::write(repo_dir.join("refs").join("main"), format!("{SHA}\n")).unwrap();
        }
        for f in REQUIRED {
            std::fs::write(snap.join(f), "{}").unwrap();
        }
        std::fs::write(
            snap.join(WEIGHTS_INDEX),
            r#"{"metadata":{},"weight_map":{"a":"model-1.safetensors","b":"model-2.safetensors","c":"model-1.safetensors"}}"#,
        )
        .unwrap();
        std::fs::write(snap.join("model-1.safetensors"), "x").unwrap();
        std::fs::write(snap.join("model-2.safetensors"), "x").unwrap();
        snap
    }

    #[test]
    fn parses_repo_ids() {
        let main = |id: &str| Some((id.to_string(), "main".to_string()));
        assert_eq!(spec("XHToken/Spark-X2.5-1.7B"), main("XHToken/Spark-X2.5-1.7B"));
        assert_eq!(spec("a/b_c.d-e"), main("a/b_c.d-e"));
        assert_eq!(spec("XHToken/Spark-X2.5-1.7B@v1.0"), Some(("XHToken/Spark-X2.5-1.7B".into(), "v1.0".into())));
        assert_eq!(spec("o/n@refs/pr/1"), Some(("o/n".into(), "refs/pr/1".into())));
        let r = RepoSpec::parse(&format!("o/n@{SHA}")).unwrap();
        assert!(r.is_commit());
        assert!(!RepoSpec::parse("o/n@main").unwrap().is_commit());
        assert_eq!(RepoSpec::parse("o/n").unwrap().cache_folder(), "models--o--n");
        assert_eq!(RepoSpec::parse("o/n@dev").unwrap().to_string(), "o/n@dev");
        assert_eq!(RepoSpec::parse("o/n").unwrap().to_string(), "o/n");
    }

    #[test]
    fn rejects_non_repo_ids() {
        for s in [
            "",
            "gpt2",
            "a/b/c",
            "/abs/path",
            "./x/y",
            "../x/y",
            "x/./y",
            "a/",
            "/b",
            "a/b@",
            "a b/c",
            "a/-b",
            "a/b.",
            ".a/b",
            "a--b/c",
            "a/b..c",
            "a/b@x y",
            "a/b@../x",
            "a/b@x//y",
            "a/b@/x",
            "a/b@x@y",
            "C:\\models\\x",
            "C:/models",
            "~/models",
            "owner/naïve",
        ] {
            assert_eq!(spec(s), None, "{s:?} should not parse");
        }
        let long = format!("o/{}", "n".repeat(97));
        assert_eq!(spec(&long), None);
    }

    #[test]
    fn existing_paths_are_returned_as_is() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        assert_eq!(resolve_model(d).unwrap(), dir.path());
        let file = dir.path().join("model.safetensors");
        std::fs::write(&file, "x").unwrap();
        assert_eq!(resolve_model(file.to_str().unwrap()).unwrap(), file);
    }

    #[test]
    fn nonexistent_path_is_a_clear_error() {
        for s in ["/definitely/not/here/model", "./no-such-model-dir", "gpt2", ""] {
            let e = resolve_model(s).unwrap_err().to_string();
            assert_eq!(e, format!("model path does not exist: {s}"));
        }
    }

    #[test]
    fn cached_snapshot_resolves_offline_and_without_network() {
        let cache = tempfile::tempdir().unwrap();
        let snap = fake_cache(cache.path(), true);
        let repo = RepoSpec::parse("o/n").unwrap();
        assert_eq!(resolve_repo(&repo, &env_for(cache.path(), true, DEFAULT_ENDPOINT)).unwrap(), snap);
        // Online but unreachable: the complete cache wins, no request is made.
        let env = env_for(cache.path(), false, "http://127.0.0.1:9");
        assert_eq!(resolve_repo(&repo, &env).unwrap(), snap);
        // A commit revision needs no ref.
        let by_sha = RepoSpec::parse(&format!("o/n@{SHA}")).unwrap();
        assert_eq!(resolve_repo(&by_sha, &env_for(cache.path(), true, DEFAULT_ENDPOINT)).unwrap(), snap);
    }

    #[test]
    fn incomplete_cache_offline_names_what_is_missing() {
        let cache = tempfile::tempdir().unwrap();
        let snap = fake_cache(cache.path(), true);
        std::fs::remove_file(snap.join("model-2.safetensors")).unwrap();
        std::fs::remove_file(snap.join("tokenizer.json")).unwrap();
        let repo = RepoSpec::parse("o/n").unwrap();
        let e = resolve_repo(&repo, &env_for(cache.path(), true, DEFAULT_ENDPOINT)).unwrap_err().to_string();
        assert!(e.contains("HF_HUB_OFFLINE"), "{e}");
        assert!(e.contains("tokenizer.json, model-2.safetensors"), "{e}");
        assert!(e.contains("--model"), "{e}");
        // Single-file weights.
        std::fs::remove_file(snap.join(WEIGHTS_INDEX)).unwrap();
        std::fs::write(snap.join("tokenizer.json"), "{}").unwrap();
        assert_eq!(missing_files(&snap), vec!["model.safetensors (or model.safetensors.index.json)"]);
        std::fs::write(snap.join(SINGLE_WEIGHTS), "x").unwrap();
        assert!(missing_files(&snap).is_empty());
    }

    #[test]
    fn unreachable_hub_is_a_clear_error() {
        let cache = tempfile::tempdir().unwrap();
        let repo = RepoSpec::parse("XHToken/Spark-X2.5-1.7B").unwrap();
        // Port 9 on localhost: refused at once, no outside network involved.
        let env = env_for(cache.path(), false, "http://127.0.0.1:9");
        let e = resolve_repo(&repo, &env).unwrap_err().to_string();
        assert!(e.starts_with("could not download XHToken/Spark-X2.5-1.7B from the Hugging Face Hub ("), "{e}");
        assert!(e.contains("pass a local directory with --model, or check network access"), "{e}");
    }

    #[test]
    fn shard_index_is_validated() {
        let names =
            shard_names(br#"{"weight_map":{"x":"a.safetensors","y":"b.safetensors","z":"a.safetensors"}}"#).unwrap();
        assert_eq!(names.into_iter().collect::<Vec<_>>(), vec!["a.safetensors", "b.safetensors"]);
        for bad in [
            &br#"{"weight_map":{"x":"../evil.safetensors"}}"#[..],
            br#"{"weight_map":{"x":"/etc/passwd"}}"#,
            br#"{"weight_map":{"x":"a\\b"}}"#,
            br#"{"weight_map":{"x":3}}"#,
            br#"{"weight_map":{}}"#,
            br#"{"nope":1}"#,
            b"not json",
        ] {
            assert!(shard_names(bad).is_err());
        }
    }

    /// The only test that reads the process environment (so tests stay race-free):
    /// HF_HUB_OFFLINE=1 with HF_HOME at an empty temp dir.
    #[test]
    fn offline_env_with_empty_cache_is_a_clear_error() {
        let home = tempfile::tempdir().unwrap();
        std::env::set_var("HF_HUB_OFFLINE", "1");
        std::env::set_var("HF_HOME", home.path());
        std::env::remove_var("HF_HUB_CACHE");
        std::env::remove_var("HUGGINGFACE_HUB_CACHE");
        let e = resolve_model("XHToken/Spark-X2.5-1.7B").unwrap_err().to_string();
        assert!(e.contains("HF_HUB_OFFLINE is set"), "{e}");
        assert!(e.contains("XHToken/Spark-X2.5-1.7B"), "{e}");
        assert!(e.contains(&home.path().join("hub").display().to_string()), "{e}");
        assert!(e.contains("pass a local directory with --model"), "{e}");
    }
}
