"""The languages of ``/run_code``: how each one's code is written, compiled and run (the
names are SandboxFusion's), and which of them work here.

A program is written to a hidden file of its own in the working directory (so that the
request's ``files`` sit beside it, as in SandboxFusion, and parallel requests of one
trajectory do not overwrite each other's code), compiled (if the language compiles) and
run there, each step one action of the dispatcher. Java, whose class must be named as
its file, gets a directory of its own instead.

Which languages work is found at start by running a small program in each through the
dispatcher itself, as a request would: a toolchain installed but not usable by the
sandboxes' unprivileged users counts as missing, with the reason.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

__all__ = ["LANGUAGES", "Language", "Layout"]


@dataclass(frozen=True)
class Layout:
    """Where one request's program lives, relative to the working directory."""

    source: str  # the code's file
    binary: str  # what a compiler writes
    directory: str  # a directory of its own, where the language needs one ("" else)
    stdin: str  # the request's stdin, written as a file the run reads


@dataclass(frozen=True)
class Language:
    """How to run one language's code.

    Attributes:
        name: SandboxFusion's name for it.
        suffix: the source file's suffix.
        run: the run command; ``{src}``, ``{bin}`` and ``{dir}`` are replaced by the
            request's source file, binary and directory.
        compile: the compile command, or None (interpreted).
        tools: the programs it needs (found on PATH before its probe runs).
        probe: a program that prints ``ok`` (the probe's check), or for a test runner, a
            passing test (``ok`` in its output).
        file_name: a fixed source file name (in the request's directory).
    """

    name: str
    suffix: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    tools: tuple[str, ...] = ()
    probe: str = ""
    file_name: str | None = None

    def layout(self, key: str) -> Layout:
        """The files of the request ``key`` (a short unique name)."""
        if self.file_name is not None:
            directory = f".run-{key}"
            return Layout(f"{directory}/{self.file_name}", f"{directory}/prog", directory,
                          f"{directory}/stdin")
        return Layout(f".run-{key}{self.suffix}", f".run-{key}.bin", "", f".run-{key}.stdin")

    def _argv(self, template: tuple[str, ...], layout: Layout) -> list[str]:
        # "./" + binary: a program path without a slash would be looked up on PATH.
        return [a.format(src=layout.source, bin=f"./{layout.binary}", dir=layout.directory)
                for a in template]

    def compile_argv(self, layout: Layout) -> list[str] | None:
        return None if self.compile is None else self._argv(self.compile, layout)

    def run_argv(self, layout: Layout) -> list[str]:
        return self._argv(self.run, layout)

    def missing_tools(self) -> list[str]:
        """The tools not found on this process's PATH (commands get the same PATH)."""
        return [t for t in self.tools if shutil.which(t) is None]


_OK_C = '#include <stdio.h>\nint main(void) { puts("ok"); return 0; }\n'

LANGUAGES: dict[str, Language] = {lang.name: lang for lang in (
    Language("python", ".py", ("python3", "{src}"), tools=("python3",), probe='print("ok")'),
    Language("pytest", "_test.py", ("python3", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    "{src}"), tools=("python3",),
             probe="def test_ok():\n    print('ok')\n"),
    Language("bash", ".sh", ("bash", "{src}"), tools=("bash",), probe="echo ok"),
    Language("cpp", ".cpp", ("{bin}",), ("g++", "-std=c++17", "-O2", "-o", "{bin}", "{src}"),
             tools=("g++",), probe=_OK_C),
    Language("nodejs", ".js", ("node", "{src}"), tools=("node",), probe='console.log("ok")'),
    Language("typescript", ".ts", ("tsx", "{src}"), tools=("tsx",),
             probe='console.log("ok")'),
    Language("java", ".java", ("java", "-cp", "{dir}:.", "-ea", "Main"),
             ("javac", "-cp", ".", "-d", "{dir}", "{src}"), tools=("javac", "java"),
             probe='public class Main { public static void main(String[] a) '
                   '{ System.out.println("ok"); } }', file_name="Main.java"),
    Language("go", ".go", ("{bin}",), ("go", "build", "-o", "{bin}", "{src}"), tools=("go",),
             probe='package main\nimport "fmt"\nfunc main() { fmt.Println("ok") }\n'),
    Language("rust", ".rs", ("{bin}",), ("rustc", "-O", "-o", "{bin}", "{src}"),
             tools=("rustc",), probe='fn main() { println!("ok"); }\n'),
    Language("perl", ".pl", ("perl", "{src}"), tools=("perl",), probe='print "ok\\n";'),
    Language("php", ".php", ("php", "{src}"), tools=("php",), probe='<?php echo "ok\\n";'),
    Language("ruby", ".rb", ("ruby", "{src}"), tools=("ruby",), probe='puts "ok"'),
    Language("lua", ".lua", ("lua", "{src}"), tools=("lua",), probe='print("ok")'),
    Language("R", ".R", ("Rscript", "{src}"), tools=("Rscript",), probe='cat("ok\\n")'),
    Language("julia", ".jl", ("julia", "{src}"), tools=("julia",), probe='println("ok")'),
    Language("racket", ".rkt", ("racket", "{src}"), tools=("racket",),
             probe='#lang racket\n(displayln "ok")\n'),
)}
