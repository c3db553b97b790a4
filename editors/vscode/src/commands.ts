// Command ids, shared by the extension and the manifest test.
export const COMMANDS = {
  restart: 'dlm.restartServer',
  toggle: 'dlm.toggleCompletions',
  showLog: 'dlm.showLog',
  setEngineKey: 'dlm.setEngineApiKey',
  acceptNextEdit: 'dlm.nextEdit.accept',
  dismissNextEdit: 'dlm.nextEdit.dismiss',
} as const;

export type CommandName = keyof typeof COMMANDS;
