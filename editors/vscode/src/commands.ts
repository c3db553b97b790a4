// Command ids, shared by the extension and the manifest test.
export const COMMANDS = {
  restart: 'dlm.restartServer',
  toggle: 'dlm.toggleCompletions',
  showLog: 'dlm.showLog',
} as const;

export type CommandName = keyof typeof COMMANDS;
