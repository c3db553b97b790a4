// Command ids, shared by the extension and the manifest test.
export const COMMANDS = {
  restart: 'dlm.restartServer',
  toggle: 'dlm.toggleCompletions',
  showLog: 'dlm.showLog',
  setEngineKey: 'dlm.setEngineApiKey',
} as const;

export type CommandName = keyof typeof COMMANDS;
