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

/// One HTTP answer: status, headers (names lower-cased) and body.
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 GET of `path` on `127.0.0.1:port` (Envoy), with header
/// values as raw bytes (not necessarily UTF-8).
pub fn http_get_raw(port: u16, path: &str, headers: &[(&str, &[u8])]) -> Reply {
    http_raw(port, "GET", path, headers)
}

/// One HTTP/1.1 request without a body, `method` `path`, on `127.0.0.1:port`.
pub fn http_raw(port: u16, method: &str, path: &str, headers: &[(&str, &[u8])]) -> Reply {
    http_request(port, method, path, headers, b"")
}

/// One HTTP/1.1 request, `method` `path` with `body`, on `127.0.0.1:port`.
pub fn http_request(port: u16, method: &str, path: &str, headers: &[(&str, &[u8])], body: &[u8]) -> Reply {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let length = body.len();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {length}\r\nConnection: close\r\n"
    )
    .into_bytes();
    for (name, value) in headers {
        request.extend_from_slice(format!("{name}: ").as_bytes());
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n");
    request.extend_from_slice(body);
    stream.write_all(&request).unwrap();
    let mut response = Vec::new();
    if let Err(e) = stream.read_to_end(&mut response) {
        // Envoy may reset a `Connection: close` socket once it has written
        // its answer (seen once in CI); the answer is what counts.
        assert!(
            e.kind() == std::io::ErrorKind::ConnectionReset && response.windows(4).any(|w| w == b"\r\n\r\n"),
            "{e} after {:?}",
            String::from_utf8_lossy(&response)
        );
    }
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines.next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Reply { status, headers, body: body.to_owned() }
}

/// [`http_get_raw`] with text header values.
pub fn http_get_text(port: u16, path: &str, headers: &[(&str, &str)]) -> Reply {
    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
    http_get_raw(port, path, &headers)
}

/// The ratelimitd binary started as an envoyproxy/ratelimit deployment:
/// `RATELIMITD_COMPAT=envoyproxy`, upstream's variables `env`, and its
/// listeners (`HOST`/`PORT`, `GRPC_HOST`/`GRPC_PORT`) on free loopback
/// ports; nothing else from this process' environment. Its stderr goes to
/// `log`. Returns the child and (gRPC port, HTTP port).
pub fn start_compat(home: &Path, log: &Path, env: &[(&str, String)]) -> (Child, u16, u16) {
    let mut env = env.to_vec();
    env.push(("RATELIMITD_COMPAT", "envoyproxy".to_owned()));
    start_upstream(Path::new(env!("CARGO_BIN_EXE_ratelimitd")), &["serve"], home, log, &env, |_| {})
}

/// The same deployment as upstream's image runs it: the binary under
/// upstream's name (`ratelimit`, a link in `home`), with no argument and
/// no `RATELIMITD_COMPAT`.
pub fn start_as_upstream(home: &Path, log: &Path, env: &[(&str, String)]) -> (Child, u16, u16) {
    start_as_upstream_with(home, log, env, |_| {})
}

/// [`start_as_upstream`], the command also set by `prepare` (its user,
/// its working directory).
pub fn start_as_upstream_with(
    home: &Path,
    log: &Path,
    env: &[(&str, String)],
    prepare: impl Fn(&mut Command),
) -> (Child, u16, u16) {
    let link = home.join("bin/ratelimit");
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    if !link.exists() {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ratelimitd"), &link).unwrap();
    }
    start_upstream(&link, &[], home, log, env, prepare)
}

/// `program args` with `env`, upstream's listeners on free ports and
/// nothing else from this process' environment, then `prepare`d; (child,
/// gRPC, HTTP port).
fn start_upstream(
    program: &Path,
    args: &[&str],
    home: &Path,
    log: &Path,
    env: &[(&str, String)],
    prepare: impl Fn(&mut Command),
) -> (Child, u16, u16) {
    // The HTTP port is picked afresh with each try of the gRPC one.
    let http = std::cell::Cell::new(0);
    let (child, grpc) = start_listening("ratelimitd", log, |grpc| {
        http.set(free_port());
        let mut command = Command::new(program);
        command
            .args(args)
            .env_clear()
            .env("HOME", home)
            .env("HOST", "127.0.0.1")
            .env("PORT", http.get().to_string())
            .env("GRPC_HOST", "127.0.0.1")
            .env("GRPC_PORT", grpc.to_string())
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        prepare(&mut command);
        command
    });
    (child, grpc, http.get())
}

/// A child process killed (by PID) on drop.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An upstream for Envoy: Python's http.server over `dir` (GET / is 200).
pub fn python_upstream(dir: &Path) -> (Process, u16) {
    let (child, port) = start_listening("upstream", &dir.join("upstream.log"), |port| {
        let mut command = Command::new("python3");
        command.args(["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1", "--directory"]).arg(dir);
        command
    });
    (Process(child), port)
}

/// An upstream for Envoy that answers every method 200 with an empty body.
pub fn any_method_upstream(dir: &Path) -> (Process, u16) {
    scripted_upstream(
        dir,
        "upstream",
        "    def answer(self):\n\
         \x20       self.send_response(200)\n\
         \x20       self.send_header('Content-Length', '0')\n\
         \x20       self.end_headers()\n\
         \x20   do_GET = do_POST = do_PUT = do_DELETE = answer\n",
    )
}

/// An HTTP upstream on a free loopback port: Python's threading server
/// with `methods` (the handler class's methods, indented four spaces), its
/// script and log in `dir` under `name`.
pub fn scripted_upstream(dir: &Path, name: &str, methods: &str) -> (Process, u16) {
    let script = dir.join(format!("{name}.py"));
    let text = format!(
        "import http.server, sys\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         {methods}\
         \x20   def log_message(self, *args):\n\
         \x20       pass\n\
         http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    );
    std::fs::write(&script, text).unwrap();
    let (child, port) = start_listening(name, &dir.join(format!("{name}.log")), |port| {
        let mut command = Command::new("python3");
        command.arg(&script).arg(port.to_string());
        command
    });
    (Process(child), port)
}

/// Envoy on the repository's own `examples/envoy/envoy.yaml` (its rate
/// limit filter fails open: `failure_mode_deny: false`) with its ports
/// replaced by free ones, `ratelimit_port` and `upstream_port`.
pub fn example_envoy(dir: &Path, ratelimit_port: u16, upstream_port: u16) -> (Process, u16) {
    let example = std::fs::read_to_string(repo_path("examples/envoy/envoy.yaml")).unwrap();
    let (child, listen) = start_envoy(dir, |listen, admin| {
        example
            .replace("port_value: 10000", &format!("port_value: {listen}"))
            .replace("port_value: 8000", &format!("port_value: {upstream_port}"))
            .replace("port_value: 8081", &format!("port_value: {ratelimit_port}"))
            .replace("port_value: 9901", &format!("port_value: {admin}"))
            // Generous for a loaded CI machine; the example keeps Envoy's 20 ms.
            .replace("timeout: 0.02s", "timeout: 2s")
    });
    (Process(child), listen)
}
