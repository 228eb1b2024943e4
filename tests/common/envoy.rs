//! Real Envoy and grpcurl, from the tools cache `scripts/install-tools` fills.

#[allow(unused_imports)]
use super::*;

/// The Envoy binary scripts/install-tools put in the tools cache.
pub fn envoy_path() -> PathBuf {
    if let Some(path) = std::env::var_os("RATELIMITD_ENVOY") {
        return PathBuf::from(path);
    }
    tansu_path().parent().unwrap().parent().unwrap().join("venv/bin/envoy")
}

/// grpcurl, from `RATELIMITD_GRPCURL` or the tools cache.
pub fn grpcurl_path() -> PathBuf {
    if let Some(path) = std::env::var_os("RATELIMITD_GRPCURL") {
        return PathBuf::from(path);
    }
    tansu_path().parent().unwrap().parent().unwrap().join("venv/bin/grpcurl")
}

/// Envoy (one worker, warnings only) on the config `render(listen, admin)`
/// returns, written to `envoy.yaml` in `dir`; its log goes to `envoy.log`
/// there. Returns the child and `listen` once Envoy accepts connections on it.
pub fn start_envoy(dir: &Path, render: impl Fn(u16, u16) -> String) -> (Child, u16) {
    let envoy = envoy_path();
    assert!(envoy.exists(), "{} not found: run scripts/install-tools", envoy.display());
    let (config, log) = (dir.join("envoy.yaml"), dir.join("envoy.log"));
    start_listening("envoy", &log, |listen| {
        std::fs::write(&config, render(listen, free_port())).unwrap();
        let mut command = Command::new(&envoy);
        command.arg("-c").arg(&config).args(["--disable-hot-restart", "--concurrency", "1", "-l", "warning"]);
        command
    })
}
