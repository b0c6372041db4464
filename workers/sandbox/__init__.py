"""Where untrusted bytes are handled: the child process every graph and artifact is loaded in
(`process` starts and polices it, `child` is its main loop, `steps` what it runs), the checks an
archive passes before torch sees it (`archive`, `program`), the environment a child gets (`env`)
and the temp dirs it works in (`tempdirs`)."""
