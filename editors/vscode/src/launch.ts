// Finds the server executable before the client starts, so a missing install is one clear message
// instead of the language client's generic "couldn't start" after several restarts.
import { spawnSync } from 'node:child_process';
import { accessSync, constants, statSync } from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';

export interface LaunchSettings {
  path: string; // `dlm.server.path`
  args: string[]; // `dlm.server.args`
  pythonPath: string; // `dlm.server.pythonPath`; when set it wins over `path`
}

export interface Launch {
  command: string;
  args: string[];
}

/** A launch problem; its message is shown to the user as is and says what to do next. */
export class LaunchError extends Error {}

const isWindows = process.platform === 'win32';
const venvBins = isWindows ? [['.venv', 'Scripts'], ['venv', 'Scripts']] : [['.venv', 'bin'], ['venv', 'bin']];

function isExecutable(file: string): boolean {
  try {
    accessSync(file, constants.X_OK);
    return statSync(file).isFile();
  } catch {
    return false;
  }
}

function expand(p: string, workspaceDirs: string[]): string {
  p = p.replace(/\$\{workspaceFolder\}/g, workspaceDirs[0] ?? '.');
  if (p === '~' || p.startsWith('~/')) p = path.join(os.homedir(), p.slice(1));
  return path.isAbsolute(p) ? p : path.resolve(workspaceDirs[0] ?? '.', p);
}

/** Gives the executable's full path: a path as given, else PATH, else each workspace folder's venv. */
export function findExecutable(name: string, env: NodeJS.ProcessEnv, workspaceDirs: string[]): string | undefined {
  if (name.includes('/') || name.includes(path.sep)) {
    const file = expand(name, workspaceDirs);
    return isExecutable(file) ? file : undefined;
  }
  const names = isWindows ? [name, `${name}.exe`, `${name}.cmd`] : [name];
  const dirs = (env.PATH ?? '').split(path.delimiter).filter(Boolean);
  // A project-local venv is where `pip install -e .` usually puts the server.
  for (const ws of workspaceDirs) for (const parts of venvBins) dirs.push(path.join(ws, ...parts));
  for (const dir of dirs) for (const n of names) if (isExecutable(path.join(dir, n))) return path.join(dir, n);
  return undefined;
}

/** Gives the command that starts the server; throws LaunchError when it cannot be found. */
export function resolveLaunch(s: LaunchSettings, env: NodeJS.ProcessEnv, workspaceDirs: string[]): Launch {
  if (s.pythonPath.trim() !== '') {
    const python = findExecutable(s.pythonPath, env, workspaceDirs);
    if (!python) {
      throw new LaunchError(`Python interpreter "${s.pythonPath}" (dlm.server.pythonPath) was not found or is not executable.`);
    }
    const probe = spawnSync(python, ['-c', 'import dlm_lsp'], { timeout: 20000, encoding: 'utf8' });
    if (probe.status !== 0) {
      throw new LaunchError(
        `"${python}" cannot import dlm_lsp. Install the server into that environment ` +
          `("pip install -e <dlm-lsp checkout>") or change dlm.server.pythonPath.`,
      );
    }
    return { command: python, args: ['-m', 'dlm_lsp', ...s.args] };
  }
  const exe = findExecutable(s.path, env, workspaceDirs);
  if (!exe) {
    throw new LaunchError(
      `The dlm-lsp server "${s.path}" was not found on PATH or in the workspace's .venv. ` +
        `Install it ("pip install -e <dlm-lsp checkout>"), or set dlm.server.path to the dlm-lsp executable ` +
        `or dlm.server.pythonPath to a Python that has it.`,
    );
  }
  return { command: exe, args: [...s.args] };
}
